"""Device profiles for the planner: memory, effective compute rate, and the stage-to-stage link."""

import dataclasses
import difflib

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Device:
    """One accelerator: memory, effective compute rate and the link to its neighbour stage."""

    name: str
    memory_bytes: int
    flops_per_second: float  # effective: peak x an assumed utilisation (see DEVICES)
    link_bytes_per_second: float
    link_latency_seconds: float = 10e-6


# Peak dense rates (bf16/fp16 tensor units; fp32 for 'cpu') at an assumed 40% utilisation, and
# the stage-to-stage link (ICI for TPU cores, NVLink for GPUs). Profiles, not measurements.
_UTILISATION = 0.4
DEVICES = {
    'tpu-v2': Device('TPU v2 core', 8 * GIB, 22.5e12 * _UTILISATION, 62.5e9),
    'tpu-v3': Device('TPU v3 core', 16 * GIB, 61.5e12 * _UTILISATION, 81.25e9),
    'v100-16gb': Device('V100 16 GB', 16 * GIB, 125e12 * _UTILISATION, 150e9),
    'v100-32gb': Device('V100 32 GB', 32 * GIB, 125e12 * _UTILISATION, 150e9),
    'a100-40gb': Device('A100 40 GB', 40 * GIB, 312e12 * _UTILISATION, 300e9),
    'a100-80gb': Device('A100 80 GB', 80 * GIB, 312e12 * _UTILISATION, 300e9),
    'h100-80gb': Device('H100 80 GB', 80 * GIB, 989e12 * _UTILISATION, 450e9),
}
THIS_MACHINE = 'this-machine'  # measured by tf_gpipe.planning.measure.this_machine()


def get(name):
    """The profile `name`; an unknown name is an error naming the closest one."""
    if name in DEVICES:
        return DEVICES[name]
    close = difflib.get_close_matches(str(name), list(DEVICES) + [THIS_MACHINE], n=1, cutoff=0.5)
    hint = f' (did you mean {close[0]!r}?)' if close else ''
    raise ValueError(
        f'Unknown device {name!r}{hint}; profiles: {", ".join(DEVICES)}, {THIS_MACHINE}.'
    )
