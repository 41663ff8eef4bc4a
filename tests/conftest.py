"""Test set-up: quiet TF logs and four logical CPU devices (before TF initialises)."""

import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import tensorflow as tf  # noqa: E402

_cpus = tf.config.list_physical_devices('CPU')
tf.config.set_logical_device_configuration(_cpus[0], [tf.config.LogicalDeviceConfiguration()] * 4)
tf.get_logger().setLevel('ERROR')  # retracing notes from the many small pipelines tests build
