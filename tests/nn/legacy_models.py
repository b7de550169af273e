"""Models as an older selfsup built them, for tests that older saved artifacts still work."""

import keras

from selfsup_model.nn.layers import FastDropout


def with_plain_keras_dropout(model: keras.Model) -> keras.Model:
    """`model` with its top-level FastDropout layers as plain `keras.layers.Dropout` (as before
    FastDropout existed), its weights copied."""

    def clone(layer):
        cls = keras.layers.Dropout if isinstance(layer, FastDropout) else type(layer)
        return cls.from_config(layer.get_config())

    old = keras.models.clone_model(model, clone_function=clone)
    old.set_weights(model.get_weights())
    return old
