"""What Grappler did at a graph's first call, read from TF's own log.

TF's meta optimizer logs, at verbosity 1 of `meta_optimizer.cc`, when it starts on a graph
(a "grappler item", named after the function), each pass it runs with the graph's size after
it and the pass's time, and when it is done. A process started with `ENV` in its environment
writes those lines to stderr; `parse` turns them into, per item, the seconds from start to end,
the nodes before the first pass and after the last, and the milliseconds of each pass (summed
over the meta optimizer's rounds). Nothing else of TF's log is read.
"""

import re

# TF's C++ log at INFO, verbose for the meta optimizer alone.
ENV = {'TF_CPP_MIN_LOG_LEVEL': '0', 'TF_CPP_VMODULE': 'meta_optimizer=1'}

# "I0000 00:00:1796604515.103158    2655 meta_optimizer.cc:1059] <message>"
_LINE = re.compile(
    r'^\S+ \d\d:\d\d:(?P<stamp>\d+\.\d+)\s+\d+ meta_optimizer\.cc:\d+\] (?P<msg>.*)$'
)
_START = re.compile(r'Starting optimization for grappler item: (?P<item>\S+)')
_PASS = re.compile(
    r'^(?P<name>[a-z_]+)(\{.*\})?: Graph size after: (?P<nodes>\d+) nodes \((?P<delta>[-+]?\d+)\).*'
    r'time = (?P<ms>[0-9.]+)ms\.?$'
)
_END = re.compile(r'^Optimized \d+ functions')


def parse(text):
    """{item name: dict(seconds, nodes_before, nodes_after, passes={pass: ms})} of the items
    the log `text` shows from start to end."""
    items, current = {}, None
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        stamp, msg = float(m['stamp']), m['msg']
        if start := _START.search(msg):
            current = items[start['item']] = dict(
                start=stamp, seconds=None, nodes_before=None, nodes_after=None, passes={}
            )
        elif current is None:
            continue
        elif done := _PASS.match(msg):
            if current['nodes_before'] is None:  # the first pass: its size less its change
                current['nodes_before'] = int(done['nodes']) - int(done['delta'])
            passes = current['passes']
            passes[done['name']] = passes.get(done['name'], 0.0) + float(done['ms'])
            current['nodes_after'] = int(done['nodes'])
        elif _END.match(msg):
            current['seconds'] = stamp - current['start']
            current = None
    return {
        name: {k: v for k, v in item.items() if k != 'start'}
        for name, item in items.items()
        if item['seconds'] is not None
    }
