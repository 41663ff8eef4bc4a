"""Plan before you buy: per-device memory and predicted step time for a registered model on N
accelerators, every (M, schedule, recompute) ranked — what fits first, fastest first.

    python tools/plan.py --model=lm.lm1b.TransformerLmPaper --device=tpu-v3 --num_devices=8
    python tools/plan.py --model=image.imagenet.AmoebaNetD --device=v100-32gb --num_devices=4 --json
    python tools/plan.py --model=lm.synthetic.TransformerLmTiny --device=this-machine --plot=p.png

Predictions from the layers' FPropMeta and the schedules' action lists (tf_gpipe.planning);
nothing is built, so paper-scale models plan in seconds. Device profiles are nominal rates at an
assumed utilisation (tf_gpipe/planning/devices.py), not measurements; `this-machine` measures
each layer's forward and backward time here at each M's micro-batch size, the memory, and (for
K > 1) the loopback link between two worker processes.
--output writes the plans as JSON with where and how they were made; --plot draws the best
plan's memory per device and its simulated timeline (needs matplotlib: pip install '.[plot]').
"""

import json
import os
import sys

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

from absl import app, flags  # noqa: E402

MODEL = flags.DEFINE_string('model', None, 'Registered model, e.g. lm.lm1b.TransformerLmPaper.')
DEVICE = flags.DEFINE_string('device', 'tpu-v3', 'Device profile (see --device=help).')
NUM_DEVICES = flags.DEFINE_integer('num_devices', 2, 'Accelerators, one pipeline stage each.')
BATCH = flags.DEFINE_integer('batch_size', None, 'Global batch (default: the model params).')
MICRO = flags.DEFINE_list('micro_batches', None, 'M values to try (default: 1, 2, 4, ... batch).')
TOP = flags.DEFINE_integer('top', 8, 'Plans to print.')
JSON = flags.DEFINE_bool('json', False, 'Print the plans as JSON.')
OUTPUT = flags.DEFINE_string('output', '', 'Also write the plans and run metadata as JSON here.')
PLOT = flags.DEFINE_string('plot', '', 'Write a PNG of the best plan: memory and timeline.')
MEMORY_MB = flags.DEFINE_integer('memory_mb', None, 'this-machine: memory per device (MB).')
PARAMS_DIR = flags.DEFINE_string('params_dir', None, 'Also load params files from here.')

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _device(name):
    from tf_gpipe import planning

    if name == planning.THIS_MACHINE:
        from tf_gpipe.planning import measure

        memory = MEMORY_MB.value * (1 << 20) if MEMORY_MB.value else None
        link = (None, None)
        if NUM_DEVICES.value > 1:
            from tf_gpipe.runtime import local_cluster

            with local_cluster.LocalCluster(2, cores=[0, 1]) as cluster:
                cluster.connect()
                link = measure.link(cluster.device(0), cluster.device(1))
        return measure.this_machine(memory, None, *link)
    try:
        return planning.get(name)
    except ValueError as e:
        sys.exit(f'plan: {e}')


def _model():
    """(layer params, global input shape, optimizer slots) of the registered model."""
    from tf_gpipe import model_registry
    from tf_gpipe.trainer import trainer

    model_registry.LoadParamsDir(os.path.join(ROOT, 'params'))
    if PARAMS_DIR.value:
        model_registry.LoadParamsDir(PARAMS_DIR.value)
    try:
        model = model_registry.GetClass(MODEL.value)()
    except LookupError as e:
        sys.exit(f'plan: {e.args[0]}')
    task_p = model_registry.CallParams(model, 'Task')
    input_p = model_registry.CallParams(model, 'Train')
    shape = task_p.cls.InputShape(task_p, input_p)
    if shape is None:
        sys.exit(f'plan: {MODEL.value} does not say its input shape (Task.InputShape).')
    shape = tuple(shape)
    if BATCH.value:
        shape = (BATCH.value,) + shape[1:]
    return task_p.cls.LayerParams(task_p), shape, trainer.OptimizerSlots(task_p.train.learner)


def _gib(n):
    return f'{n / (1 << 30):.2f}'


def main(_):
    from tf_gpipe import planning

    if DEVICE.value == 'help':
        for key, d in planning.DEVICES.items():
            print(f'{key:<10} {d.name:<12} {_gib(d.memory_bytes)} GiB, '
                  f'{d.flops_per_second / 1e12:.1f} TFLOP/s effective')  # fmt: skip
        print(f'{planning.THIS_MACHINE:<10} measured: matmul rate, memory, loopback link')
        return
    if not MODEL.value:
        raise app.UsageError('--model is required (e.g. --model=lm.lm1b.TransformerLmPaper).')
    device = _device(DEVICE.value)
    sub, shape, slots = _model()
    micro = [int(m) for m in MICRO.value] if MICRO.value else None
    try:
        seconds = None
        if DEVICE.value == planning.THIS_MACHINE:  # each layer timed here at each M's size
            from tf_gpipe.planning import measure

            ids = 'Embedding' in sub[0].cls.__name__  # a language model's input: token ids
            dtype = 'int32' if ids else 'float32'

            def seconds(m):
                micro = (shape[0] // m,) + tuple(shape[1:])
                return measure.layer_seconds(sub, micro, input_dtype=dtype)

        plans = planning.recommend(sub, shape, NUM_DEVICES.value, device, slots, micro, seconds)
    except ValueError as e:
        sys.exit(f'plan: {e}')
    result = dict(
        model=MODEL.value,
        input_shape=list(shape),
        num_devices=NUM_DEVICES.value,
        device=dict(vars(device)),
        plans=[_as_dict(p, device) for p in plans[: TOP.value]],
        **_metadata(),
    )
    if OUTPUT.value:
        from bench_common import write_json

        write_json(OUTPUT.value, result)
    if PLOT.value:
        _plot(plans[0], device, PLOT.value)
    if JSON.value:
        print(json.dumps(result))
        return
    print(f'{MODEL.value}: batch {shape[0]}, input {shape[1:]}, {NUM_DEVICES.value} x '
          f'{device.name} ({_gib(device.memory_bytes)} GiB each)')  # fmt: skip
    print(f'{"M":>4} {"schedule":<12}{"recompute":<12}{"peak GiB":>9}{"step s":>10}'
          f'{"examples/s":>12}{"bubble":>8}  fits')  # fmt: skip
    for p in plans[: TOP.value]:
        print(f'{p.num_micro_batches:>4} {p.schedule:<12}{p.recompute:<12}{_gib(p.peak):>9}'
              f'{p.step_seconds:>10.4f}{p.examples_per_second:>12.1f}{p.bubble:>8.3f}  '
              f'{"yes" if p.fits(device) else "NO"}')  # fmt: skip
    best = plans[0]
    if not best.fits(device):
        print(f'Nothing fits: the smallest peak is {_gib(min(p.peak for p in plans))} GiB per '
              'device. Use more devices or a device with more memory.')  # fmt: skip
    print(f'\nper device, M={best.num_micro_batches} {best.schedule} recompute={best.recompute} '
          '(GiB):')  # fmt: skip
    print(f'{"dev":>4}{"params":>14}{"weights":>9}{"grads":>9}{"slots":>9}{"inputs":>9}'
          f'{"stored":>9}{"working":>9}{"peak":>9}  layers')  # fmt: skip
    for s in best.stages:
        print(f'{s.device:>4}{s.params:>14,}{_gib(s.weights):>9}{_gib(s.gradients):>9}'
              f'{_gib(s.slots):>9}{_gib(s.inputs):>9}{_gib(s.stored_activations):>9}'
              f'{_gib(s.working_set):>9}{_gib(s.peak):>9}  {s.layers}')  # fmt: skip


def _metadata():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_common import run_metadata

    return run_metadata()


def _plot(p, device, path):
    """Two panels: each device's memory by kind against its capacity, and the simulated step."""
    try:
        import matplotlib

        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit(
            "plan: --plot needs matplotlib: pip install '.[plot]' (or pip install matplotlib)."
        )
    kinds = ['weights', 'gradients', 'slots', 'inputs', 'stored_activations', 'working_set']
    fig, (mem, gantt) = plt.subplots(
        1, 2, figsize=(13, 0.6 * p.num_devices + 2.5), gridspec_kw=dict(width_ratios=[1, 2])
    )
    bottom = [0.0] * p.num_devices
    for kind in kinds:
        values = [getattr(s, kind) / (1 << 30) for s in p.stages]
        mem.barh(range(p.num_devices), values, left=bottom, label=kind.replace('_', ' '))
        bottom = [b + v for b, v in zip(bottom, values)]
    mem.axvline(device.memory_bytes / (1 << 30), color='k', linestyle='--', label='capacity')
    mem.set_xlabel('GiB per device')
    mem.set_ylabel('device')
    mem.invert_yaxis()
    mem.legend(fontsize=7, loc='lower right')
    colors = {'F': 'tab:blue', 'B': 'tab:orange', 'W': 'tab:green'}
    few = p.num_micro_batches <= 16 and p.num_devices <= 16  # room for edges and labels
    for phase, stage, m, start, end in p.timeline:
        d = stage % p.num_devices
        gantt.barh(d, end - start, left=start, color=colors[phase],
                   edgecolor='white' if few else 'none', linewidth=0.5 if few else 0)  # fmt: skip
        if few:
            gantt.text((start + end) / 2, d, f'{phase}{m}', ha='center', va='center', fontsize=6)
    for phase in sorted({a[0] for a in p.timeline}, key='FBW'.index):
        gantt.barh(0, 0, color=colors[phase], label={'F': 'forward', 'B': 'backward',
                                                     'W': 'weight gradient'}[phase])  # fmt: skip
    gantt.legend(fontsize=7, loc='upper right')
    gantt.set_xlabel('seconds (simulated)')
    gantt.invert_yaxis()
    gantt.set_title(
        f'M={p.num_micro_batches} {p.schedule} recompute={p.recompute}: step '
        f'{p.step_seconds:.3g} s, bubble {p.bubble:.2f}',
        fontsize=9,
    )
    fig.suptitle(f'{MODEL.value} on {p.num_devices} x {device.name}', fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f'wrote {path}')


def _as_dict(p, device):
    return dict(
        num_devices=p.num_devices,
        num_micro_batches=p.num_micro_batches,
        schedule=p.schedule,
        recompute=p.recompute,
        batch_size=p.batch_size,
        peak_bytes=p.peak,
        step_seconds=p.step_seconds,
        examples_per_second=p.examples_per_second,
        bubble=p.bubble,
        fits=p.fits(device),
        stages=[dict(vars(s), peak=s.peak) for s in p.stages],
    )


if __name__ == '__main__':
    app.run(main)
