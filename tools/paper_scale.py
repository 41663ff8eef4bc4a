"""The GPipe paper's Tables 1 and 2 at their own scale, on paper: the planner on TPU profiles.

    python tools/paper_scale.py --output=docs/results/paper_scale.json    # about a minute

Table 1: the largest AmoebaNet-D (TPU v2 cores, 8 GiB; 224x224, batch 128, RMSProp) and
Transformer-L (TPU v3 cores, 16 GiB: d=2048, FFN 8192, 32 heads, 32k vocabulary, sequence 1024,
batch 32, Adam) that fit: naive-1 (one device, no micro-batches, no recompute) and pipeline-K
(GPipe: fill-drain, recompute, M=32; cells cut by flops or by parameters, whichever peaks
lower). AmoebaNet grows D at the paper's L for each K; the
Transformer grows L. Table 2: the predicted speed-up of AmoebaNet-D (18, 256) and Transformer-48
over K = 2, 4, 8 and M = 1, 4, 32 on TPU v3 (GPipe, recompute), normalised to K=2, M=1.
Nothing is built: FPropMeta, the partitioner and the simulated schedules (tf_gpipe.planning).
"""

import json
import os
import sys

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

from absl import app, flags  # noqa: E402

OUTPUT = flags.DEFINE_string('output', '', 'Also write the JSON result to this file.')
JSON = flags.DEFINE_bool('json', False, 'Print JSON instead of tables.')

# The paper's figures (GPipe, Huang et al. 2019, Tables 1 and 2), for the side-by-side.
PAPER_AMOEBANET = {  # setting: (L, D, parameters)
    'naive-1': (18, 208, 82e6),
    'pipeline-1': (18, 416, 318e6),
    'pipeline-2': (18, 544, 542e6),
    'pipeline-4': (36, 544, 1.05e9),
    'pipeline-8': (72, 512, 1.8e9),
}
PAPER_TRANSFORMER = {  # setting: (L, parameters)
    'naive-1': (3, 282.2e6),
    'pipeline-1': (13, 785.8e6),
    'pipeline-8': (103, 5.3e9),
    'pipeline-32': (415, 21.0e9),
    'pipeline-128': (1663, 83.9e9),
}
PAPER_SPEEDUP = {  # model: {K: [M=1, M=4, M=32]}
    'AmoebaNet-D (18, 256)': {2: [1.0, 1.07, 1.21], 4: [1.13, 1.26, 1.84], 8: [1.38, 1.72, 3.48]},
    'Transformer-48': {2: [1.0, 1.7, 1.8], 4: [1.9, 3.2, 3.4], 8: [3.6, 6.3, 6.3]},
}
MICRO = 32
# Cells cut by flops (the engine's default) or by parameters (weights and slots spread out).
GPIPE = [(MICRO, 'gpipe', 'always', 'flops'), (MICRO, 'gpipe', 'always', 'params')]
NAIVE = [(1, 'gpipe', 'never')]


def _amoebanet(num_cells, filters, batch=128):
    from tf_gpipe import tasks
    from tf_gpipe.tasks import image

    p = tasks.ImageClassifier.Params().Set(
        name='c', num_classes=1000, num_cells=num_cells, filters=filters, image_size=224,
        stem='imagenet',
    )  # fmt: skip
    return image.ImageClassifier.LayerParams(p), (batch, 224, 224, 3)


def _transformer(num_layers, batch=32, seq_len=1024):
    from tf_gpipe import tasks
    from tf_gpipe.tasks import lm

    p = tasks.LanguageModel.Params().Set(
        name='lm', vocab_size=32000, model_dim=2048, num_layers=num_layers, max_seq_len=seq_len
    )
    p.layer_tpl.Set(num_heads=32, hidden_dim=8192)
    return lm.LanguageModel.LayerParams(p), (batch, seq_len)


def table1():
    from tf_gpipe import planning

    rows = []
    v2, v3 = planning.DEVICES['tpu-v2'], planning.DEVICES['tpu-v3']
    for setting, (num_cells, paper_d, paper_params) in PAPER_AMOEBANET.items():
        k = int(setting.split('-')[1])
        configs = NAIVE if setting == 'naive-1' else GPIPE
        knob, p = planning.largest(
            lambda knob, n=num_cells: _amoebanet(n, 16 * knob), k, v2, configs, optimizer_slots=2
        )
        rows.append(
            dict(model='AmoebaNet-D', device='tpu-v2', setting=setting, num_devices=k,
                 size=f'L={num_cells}, D={16 * knob}', params=p.params if p else 0,
                 peak_bytes=p.peak if p else None, paper_size=f'L={num_cells}, D={paper_d}',
                 paper_params=paper_params)
        )  # fmt: skip
    for setting, (paper_l, paper_params) in PAPER_TRANSFORMER.items():
        k = int(setting.split('-')[1])
        configs = NAIVE if setting == 'naive-1' else GPIPE
        knob, p = planning.largest(_transformer, k, v3, configs, optimizer_slots=2, start=k)
        if p is None:  # not even one layer per device: say what the smallest model needs
            smallest = planning.search.smallest_peak(*_transformer(k), k, v3, configs, 2)
        rows.append(
            dict(model='Transformer-L', device='tpu-v3', setting=setting, num_devices=k,
                 size=f'L={knob}' if p else f'none (L={k} needs {smallest.peak / 2**30:.1f} GiB)',
                 params=p.params if p else 0, peak_bytes=p.peak if p else None,
                 paper_size=f'L={paper_l}', paper_params=paper_params)
        )  # fmt: skip
    return rows


def table2():
    from tf_gpipe import planning
    from tf_gpipe.gpipe import partition

    v3 = planning.DEVICES['tpu-v3']
    models = {
        'AmoebaNet-D (18, 256)': _amoebanet(18, 256),
        'Transformer-48': _transformer(48),
    }
    rows = []
    for name, (sub, shape) in models.items():
        metas = partition.layer_metas(sub, shape)
        times = {}
        for k in (2, 4, 8):
            for m in (1, 4, 32):
                p = planning.plan(sub, shape, k, m, v3, 'gpipe', 'always', 2, metas=metas)
                times[k, m] = (p.step_seconds, p.fits(v3), p.bubble)
        base = times[2, 1][0]
        for k in (2, 4, 8):
            rows.append(
                dict(model=name, num_devices=k,
                     speedup=[base / times[k, m][0] for m in (1, 4, 32)],
                     fits=[times[k, m][1] for m in (1, 4, 32)],
                     bubble=[times[k, m][2] for m in (1, 4, 32)],
                     paper=PAPER_SPEEDUP[name][k])
            )  # fmt: skip
    return rows


def main(_):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_common import run_metadata

    result = dict(table1=table1(), table2=table2(), micro_batches=MICRO, **run_metadata())
    if OUTPUT.value:
        from bench_common import write_json

        write_json(OUTPUT.value, result)
    if JSON.value:
        print(json.dumps(result))
        return
    from results_table import paper_scale_tables

    print('\n'.join(paper_scale_tables(result)))


if __name__ == '__main__':
    app.run(main)
