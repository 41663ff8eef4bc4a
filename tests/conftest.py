"""Test set-up: quiet TF logs and four logical CPU devices (before TF initialises)."""

import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import tensorflow as tf  # noqa: E402

_cpus = tf.config.list_physical_devices('CPU')
tf.config.set_logical_device_configuration(_cpus[0], [tf.config.LogicalDeviceConfiguration()] * 4)
tf.get_logger().setLevel('ERROR')  # retracing notes from the many small pipelines tests build


# Tests of a minute or more, each starting trainer or worker processes. xdist hands tests to its
# two workers in collection order, so these start first: collected last (as their modules'
# names would have them), they left one worker busy for minutes after the other had finished.
_SLOW_FIRST = (
    'test_fault_drill_kill_9_resumes_exactly',
    'test_train_eval_resume',
    'test_benchmark_runs_on_two_workers',
    'test_train_on_worker_processes_with_cluster_spec_and_tf_config',
    'test_inspect_and_errors',
    'test_missing_worker_is_named_after_a_bounded_wait_and_ctrl_c_works',
    'test_a_keras_model_inside_a_sequential_gets_every_gradient',
    'test_keras_applications_unchanged_at_k4_step_like_plain_keras',
    'test_efficientnet_b0_with_dropout_and_stochastic_depth',
    'test_keras_resnet_example_runs',
    'test_two_worker_processes_under_multi_worker_mirrored_strategy',
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(_SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.originalname, len(rank)))  # stable: rest in order
