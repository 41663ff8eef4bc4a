"""Image classifier: AmoebaNet-D as one pipeline, cross-entropy and accuracy."""

import tensorflow as tf

from tf_gpipe.layers import amoebanet
from tf_gpipe.nested_map import NestedMap
from tf_gpipe.tasks import base_task


class ImageClassifier(base_task.BaseTask):
    """Batch: NestedMap(images [B, H, W, C], labels [B])."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('num_classes', 0, 'Classes.')
        p.Define('num_cells', 6, 'L: normal cells (a multiple of 3).')
        p.Define('filters', 16, 'D: filters of the first stack (doubled at each reduction).')
        p.Define('image_size', 32, 'Input height and width.')
        p.Define('in_channels', 3, 'Image channels.')
        p.Define(
            'stem',
            'cifar',
            "'imagenet': a stride-2 convolution and two reduction cells (the first normal stack "
            "runs at 1/8 of the image size); 'cifar': a stride-1 convolution.",
        )
        p.Define('stem_filters', 32, 'Channels of the stem convolution (the reference: 32).')
        p.Define('label_smoothing', 0.0, 'Label smoothing.')
        return p

    @classmethod
    def LayerParams(cls, p):
        return amoebanet.AmoebaNetLayers(
            p.num_cells, p.filters, p.num_classes, p.in_channels, p.stem, p.stem_filters
        )

    @classmethod
    def InputShape(cls, task_p, input_p):
        return (input_p.batch_size, task_p.image_size, task_p.image_size, task_p.in_channels)

    @classmethod
    def NetworkParams(cls, p):
        pp = p.pipeline
        nominal = (
            max(pp.num_micro_batches * pp.num_replicas, 1),
            p.image_size,
            p.image_size,
            p.in_channels,
        )
        return base_task.PipelinedParamsFor(p, cls.LayerParams(p), nominal)

    def __init__(self, params):
        super().__init__(params)
        if self.params.num_classes <= 0:
            raise ValueError('ImageClassifier: set num_classes.')
        self.CreateChild('network', self.NetworkParams(self.params))

    def NetworkInputs(self, batch):
        return batch.images, batch.labels

    def ServingSpecs(self, input_p):
        p = self.params
        return {'images': tf.TensorSpec([None, p.image_size, p.image_size, p.in_channels])}

    def Serve(self, inputs):
        """Class logits and probabilities of `images` [B, H, W, C]."""
        logits = tf.cast(self.network.FProp(inputs['images']), tf.float32)
        return {'logits': logits, 'probabilities': tf.nn.softmax(logits)}

    def MicroBatchLoss(self, logits, labels):
        p = self.params
        log_probs = tf.nn.log_softmax(tf.cast(logits, tf.float32))
        targets = tf.one_hot(labels, p.num_classes)
        if p.label_smoothing:
            targets = targets * (1 - p.label_smoothing) + p.label_smoothing / p.num_classes
        return tf.reduce_mean(-tf.reduce_sum(targets * log_probs, -1))

    def Metrics(self, logits, labels):
        loss = self.MicroBatchLoss(logits, labels)
        predicted = tf.argmax(logits, -1, output_type=tf.int32)
        accuracy = tf.reduce_mean(tf.cast(tf.equal(predicted, labels), tf.float32))
        return NestedMap(loss=loss, metrics=NestedMap(loss=loss, accuracy=accuracy))
