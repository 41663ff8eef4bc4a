"""A short demo of the params/layer idiom: build a model from Params and train it a little.

    python tools/demo.py --steps=200

Learns a synthetic 4-class problem (class = quadrant of the first two features, the rest
noise) with FC + BatchNorm + Dropout + Softmax layers, and logs loss, accuracy and steps/s.
"""

import os
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import tensorflow as tf  # noqa: E402
from absl import app, flags, logging  # noqa: E402

from tf_gpipe import fprop_context, layers  # noqa: E402

STEPS = flags.DEFINE_integer('steps', 200, 'Training steps.')
BATCH = flags.DEFINE_integer('batch_size', 64, 'Examples per step.')
SEED = flags.DEFINE_integer('seed', 1, 'Random seed of weights and data.')


def model_params(dim=16, hidden=64, classes=4):
    fc = layers.FCLayer.Params()
    return layers.SequentialLayer.Params().Set(
        name='demo',
        random_seed=SEED.value,
        sub=[
            fc.Copy().Set(name='fc0', input_dim=dim, output_dim=hidden),
            layers.BatchNormLayer.Params().Set(name='bn0', dim=hidden, decay=0.9),
            layers.DropoutLayer.Params().Set(name='drop0', keep_prob=0.9),
            fc.Copy().Set(name='fc1', input_dim=hidden, output_dim=hidden, activation='GELU'),
            layers.SoftmaxLayer.Params().Set(name='softmax', input_dim=hidden, num_classes=classes),
        ],
    )


def batch(step, dim=16):
    x = tf.random.stateless_normal([BATCH.value, dim], [SEED.value, step])
    labels = tf.cast(x[:, 0] > 0, tf.int32) * 2 + tf.cast(x[:, 1] > 0, tf.int32)
    return x, labels


def main(_):
    p = model_params()
    logging.info('Model params:\n%s', p.ToText())
    model = p.Instantiate()
    softmax = model.sub[-1]
    optimizer = tf.keras.optimizers.Adam(3e-3)

    @tf.function
    def train_step(step, x, labels):
        with fprop_context.scope(step=step), tf.GradientTape() as tape:
            xent = softmax.XentLoss(model.FProp(x), labels)
        grads = tape.gradient(xent.avg_xent, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        model.PostTrainingStepUpdate()
        return xent.avg_xent

    @tf.function
    def accuracy(x, labels):
        with fprop_context.eval_mode():
            predicted = tf.argmax(model.FProp(x), -1, output_type=tf.int32)
        return tf.reduce_mean(tf.cast(predicted == labels, tf.float32))

    test_x, test_labels = batch(10**6)
    start = time.time()
    for step in range(STEPS.value):
        loss = train_step(tf.constant(step, tf.int64), *batch(step))
        if step % 50 == 0 or step == STEPS.value - 1:
            rate = (step + 1) / (time.time() - start)
            logging.info(
                'step %4d  loss %.4f  eval accuracy %.3f  %.1f steps/s  %.0f examples/s',
                step,
                loss,
                accuracy(test_x, test_labels),
                rate,
                rate * BATCH.value,
            )
    print(f'final eval accuracy {float(accuracy(test_x, test_labels)):.3f}')


if __name__ == '__main__':
    app.run(main)
