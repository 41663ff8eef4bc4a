"""Plan before you buy: per-device memory and predicted step time for a registered model on N
accelerators, every (M, schedule, recompute) ranked — what fits first, fastest first.

    python tools/plan.py --model=lm.lm1b.TransformerLmPaper --device=tpu-v3 --num_devices=8
    python tools/plan.py --model=image.imagenet.AmoebaNetD --device=v100-32gb --num_devices=4 --json

Predictions from the layers' FPropMeta and the schedules' action lists (tf_gpipe.planning);
nothing is built, so paper-scale models plan in seconds. Device profiles are nominal rates at an
assumed utilisation (see tf_gpipe/planning.py), not measurements.
"""

import difflib
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
PARAMS_DIR = flags.DEFINE_string('params_dir', None, 'Also load params files from here.')

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _device(name):
    from tf_gpipe import planning

    if name in planning.DEVICES:
        return planning.DEVICES[name]
    close = difflib.get_close_matches(name, list(planning.DEVICES), n=1, cutoff=0.5)
    hint = f' (did you mean {close[0]!r}?)' if close else ''
    sys.exit(f'plan: unknown device {name!r}{hint}; profiles: {", ".join(planning.DEVICES)}.')


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
        return
    if not MODEL.value:
        raise app.UsageError('--model is required (e.g. --model=lm.lm1b.TransformerLmPaper).')
    device = _device(DEVICE.value)
    sub, shape, slots = _model()
    micro = [int(m) for m in MICRO.value] if MICRO.value else None
    try:
        plans = planning.recommend(sub, shape, NUM_DEVICES.value, device, slots, micro)
    except ValueError as e:
        sys.exit(f'plan: {e}')
    if JSON.value:
        print(json.dumps([_as_dict(p, device) for p in plans[: TOP.value]]))
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
    print(f'{"dev":>4}{"params":>14}{"weights":>9}{"grads":>9}{"slots":>9}{"stored":>9}'
          f'{"working":>9}{"peak":>9}  layers')  # fmt: skip
    for s in best.stages:
        print(f'{s.device:>4}{s.params:>14,}{_gib(s.weights):>9}{_gib(s.gradients):>9}'
              f'{_gib(s.slots):>9}{_gib(s.stored_activations):>9}{_gib(s.working_set):>9}'
              f'{_gib(s.peak):>9}  {s.layers}')  # fmt: skip


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
        device=device.name,
        stages=[dict(vars(s), peak=s.peak) for s in p.stages],
    )


if __name__ == '__main__':
    app.run(main)
