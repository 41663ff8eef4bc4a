"""tfds-backed input generators (real datasets through `tfds.load`, with `data_dir`)."""

import tensorflow as tf

from tf_gpipe.inputs import base_input
from tf_gpipe.nested_map import NestedMap


class TfdsInput(base_input.BaseInputGenerator):
    """Batches from `tfds.load(dataset, split, data_dir)`; subclasses preprocess examples.

    The tf.data iterator is part of the trainer's checkpoint (`CheckpointItems`), so a restarted
    run continues where the data stream stopped.
    """

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('dataset', '', 'tfds dataset name, e.g. lm1b or cifar10.')
        p.Define('split', 'train', 'tfds split.')
        p.Define('data_dir', None, 'tfds data directory (None: tfds default).')
        p.Define('shuffle_buffer', 10000, 'Examples in the shuffle buffer; 0: no shuffling.')
        p.Define('repeat', True, 'Loop over the split forever.')
        return p

    def __init__(self, params):
        super().__init__(params)
        self._iterator = None

    def Preprocess(self, example):
        """One tfds example -> one NestedMap of tensors (fixed shapes)."""
        raise NotImplementedError

    def Dataset(self):
        import tensorflow_datasets as tfds

        p = self.params
        ds = tfds.load(
            p.dataset, split=p.split, data_dir=p.data_dir, shuffle_files=bool(p.shuffle_buffer)
        )
        if p.repeat:
            ds = ds.repeat()
        if p.shuffle_buffer:
            ds = ds.shuffle(p.shuffle_buffer, seed=p.seed)
        ds = ds.map(self.Preprocess, num_parallel_calls=tf.data.AUTOTUNE)
        return ds.batch(p.batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE)

    def _Iterator(self):
        if self._iterator is None:
            with tf.init_scope():
                self._iterator = iter(self.Dataset())
        return self._iterator

    def GetBatch(self, step):
        del step  # the iterator's position is the stream's state (checkpointed)
        return next(self._Iterator())

    def CheckpointItems(self):
        return {'input_iterator': self._Iterator()}


class TfdsLm(TfdsInput):
    """Text datasets (lm1b: feature 'text') as byte-level LM examples: ids 1..256, 0 = pad."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('text_feature', 'text', 'Feature holding the text.')
        p.Define('seq_len', 128, 'Tokens per example (longer texts are cut).')
        p.dataset = 'lm1b'
        return p

    @staticmethod
    def VocabSize():
        return 257

    def Preprocess(self, example):
        p = self.params
        data = tf.io.decode_raw(example[p.text_feature], tf.uint8)
        tokens = tf.cast(data[: p.seq_len + 1], tf.int32) + 1
        tokens = tf.pad(tokens, [[0, p.seq_len + 1 - tf.shape(tokens)[0]]])
        tokens.set_shape([p.seq_len + 1])
        labels = tokens[1:]
        return NestedMap(ids=tokens[:-1], labels=labels, weights=tf.cast(labels > 0, tf.float32))


class TfdsImage(TfdsInput):
    """Image classification datasets (cifar10/100, imagenet2012): resize, scale, normalise."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('image_size', 32, 'Images are resized to image_size x image_size.')
        p.Define('augment', False, 'Random left-right flips (training).')
        p.dataset = 'cifar10'
        return p

    def Preprocess(self, example):
        p = self.params
        image = tf.image.convert_image_dtype(example['image'], tf.float32)
        image = tf.image.resize(image, [p.image_size, p.image_size])
        if p.augment:
            image = tf.image.random_flip_left_right(image, seed=p.seed)
        image = (image - 0.5) / 0.25
        return NestedMap(images=image, labels=tf.cast(example['label'], tf.int32))


class TfdsTranslation(TfdsInput):
    """Multilingual translation from tfds `ted_multi_translate` (TranslationVariableLanguages).

    Every talk with the source language yields one example per wanted target language it has.
    Byte-level: id 0 pads, ids 1..T are the target-language tokens (the decoder's first input
    says which language to produce), bytes follow.
    """

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('source_language', 'en', 'Source language code.')
        p.Define('target_languages', ['de', 'fr', 'es', 'it'], 'Target language codes.')
        p.Define('seq_len', 128, 'Maximum source / target length in bytes (longer is cut).')
        p.dataset = 'ted_multi_translate'
        return p

    @classmethod
    def VocabSize(cls, p):
        return 1 + len(p.target_languages) + 256

    def _Encode(self, text, length):
        offset = 1 + len(self.params.target_languages)
        data = tf.cast(tf.io.decode_raw(text, tf.uint8)[:length], tf.int32) + offset
        return tf.pad(data, [[0, length - tf.shape(data)[0]]])

    def Dataset(self):
        import tensorflow_datasets as tfds

        p = self.params
        ds = tfds.load(
            p.dataset, split=p.split, data_dir=p.data_dir, shuffle_files=bool(p.shuffle_buffer)
        )
        ds = ds.flat_map(self._Pairs)
        if p.repeat:
            ds = ds.repeat()
        if p.shuffle_buffer:
            ds = ds.shuffle(p.shuffle_buffer, seed=p.seed)
        return ds.batch(p.batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE)

    def _Pairs(self, example):
        p = self.params
        langs = example['translations']['language']
        texts = example['translations']['translation']
        n = tf.minimum(tf.size(langs), tf.size(texts))  # equal in the data; not in mock data
        langs, texts = langs[:n], texts[:n]
        is_src = tf.equal(langs, p.source_language)
        has_src = tf.reduce_any(is_src)
        src_text = tf.gather(texts, tf.argmax(tf.cast(is_src, tf.int32)))
        targets = tf.constant(list(p.target_languages))

        def keep(lang, text):
            del text
            return tf.logical_and(has_src, tf.reduce_any(tf.equal(targets, lang)))

        def encode(lang, text):
            lang_id = 1 + tf.argmax(
                tf.cast(tf.equal(targets, lang), tf.int32), output_type=tf.int32
            )
            src = self._Encode(src_text, p.seq_len)
            tgt = self._Encode(text, p.seq_len)
            src_pad = tf.cast(tf.equal(src, 0), tf.float32)
            weights = tf.cast(tgt > 0, tf.float32)
            tgt_in = tf.concat([[lang_id], tgt[:-1]], axis=0) * tf.cast(weights > 0, tf.int32)
            return NestedMap(
                src_ids=src,
                src_paddings=src_pad,
                tgt_ids=tgt_in,
                tgt_paddings=1.0 - weights,
                labels=tgt,
                weights=weights,
            )

        pairs = tf.data.Dataset.from_tensor_slices((langs, texts))
        return pairs.filter(keep).map(encode)
