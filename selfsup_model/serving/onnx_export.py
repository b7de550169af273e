"""The kept classifier as an ONNX model, and scoring through ONNX Runtime.

`classifier_onnx` writes the graph op by op from the Keras classifier's weights (numpy; no
converter, no TensorFlow graph tracing), so every operation is one we chose to match ours:

    input_ids (B, L) int32, right-padded with [PAD] (0)
      -> token + position embeddings (positions from 0 per row, or per packed document for a
         backbone that separates documents) [-> LayerNorm: post-LN]
      -> per block: fused QKV projection, scaled dot-product attention over the real keys
         (and j <= i for a causal encoder), softmax in float32, output projection, the
         residuals and LayerNorms of the block's layout (post or pre), the tanh GELU
         feed-forward [-> final LayerNorm: pre-LN]
      -> pooling over real positions (masked mean, [CLS] or last real token)
      -> the head's Dense -> logits (B, C) and probabilities (B, C)

Inference only: dropout is the identity. The text path (normalisation, tokenizer, windows,
framing, a document's probabilities the mean of its windows') stays selfsup's
(`inference.ClassifierBundle`), which reads an ONNX bundle as it reads a Keras one.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from selfsup_model.artifacts import atomic_path, atomic_write_bytes, atomic_write_json, sha256_file
from selfsup_model.errors import UserError
from selfsup_model.text.specials import BOS_ID, CLS_ID, PAD_ID

OPSET = 17  # LayerNormalization
INPUT, LOGITS, PROBABILITIES = "input_ids", "logits", "probabilities"


def _onnx():
    try:
        import onnx
    except ImportError:
        raise UserError("ONNX export needs the onnx package: pip install -e '.[export]'") from None
    return onnx


class _Graph:
    """A small builder: named initializers from numpy, nodes with generated output names."""

    def __init__(self):
        self.onnx = _onnx()
        self.nodes: list[Any] = []
        self.initializers: list[Any] = []
        self._count = 0

    def const(self, value, dtype=np.float32, name: str | None = None) -> str:
        self._count += 1
        name = name or f"const_{self._count}"
        array = np.asarray(value, dtype=dtype)
        self.initializers.append(self.onnx.numpy_helper.from_array(array, name))
        return name

    def op(self, op_type: str, *inputs: str, **attrs) -> str:
        self._count += 1
        out = f"{op_type.lower()}_{self._count}"
        self.nodes.append(self.onnx.helper.make_node(op_type, list(inputs), [out], **attrs))
        return out

    def dense(self, x: str, layer, name: str) -> str:
        kernel, bias = (np.asarray(w, np.float32) for w in layer.get_weights())
        return self.op("Add", self.op("MatMul", x, self.const(kernel, name=f"{name}.kernel")),
                       self.const(bias, name=f"{name}.bias"))

    def layer_norm(self, x: str, layer, name: str) -> str:
        gamma, beta = (np.asarray(w, np.float32) for w in layer.get_weights())
        return self.op("LayerNormalization", x, self.const(gamma, name=f"{name}.gamma"),
                       self.const(beta, name=f"{name}.beta"), axis=-1,
                       epsilon=float(layer.epsilon))

    def gelu_tanh(self, x: str) -> str:
        """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))): keras' gelu(approximate=True)."""
        cube = self.op("Mul", self.op("Mul", x, x), x)
        inner = self.op("Mul", self.op("Add", x, self.op("Mul", cube, self.const(0.044715))),
                        self.const(math.sqrt(2 / math.pi)))
        half = self.op("Mul", x, self.const(0.5))
        return self.op("Mul", half, self.op("Add", self.op("Tanh", inner), self.const(1.0)))


def _parts(model) -> tuple[Any, Any, Any]:
    """(backbone, pooling layer, head Dense) of a kept classifier (`classify.build_classifier`
    or `inference.probe_classifier`)."""
    import keras

    from selfsup_model.nn.pooling import ClsPooling, LastTokenPooling, MaskedMeanPooling

    backbones = [layer for layer in model.layers if isinstance(layer, keras.Model)]
    pools = [layer for layer in model.layers
             if isinstance(layer, (MaskedMeanPooling, ClsPooling, LastTokenPooling))]
    heads = [layer for layer in model.layers if layer.name == "head_logits"]
    if len(backbones) != 1 or len(pools) != 1 or len(heads) != 1:
        raise UserError(f"model {model.name!r} is not a selfsup classifier (a backbone, a pooling "
                        "layer and a head_logits layer)")
    return backbones[0], pools[0], heads[0]


def classifier_onnx(model) -> Any:
    """The ONNX ModelProto of a selfsup classifier (module docstring)."""
    from selfsup_model.nn.layers import (
        DocumentMask,
        TransformerEncoderBlock,
    )
    from selfsup_model.nn.model import token_embedding_of
    from selfsup_model.nn.pooling import ClsPooling, MaskedMeanPooling

    backbone, pool, head = _parts(model)
    g = _Graph()
    helper, TensorProto = g.onnx.helper, g.onnx.TensorProto
    embedding = token_embedding_of(backbone)
    blocks = [layer for layer in backbone.layers if isinstance(layer, TransformerEncoderBlock)]
    documents = any(isinstance(layer, DocumentMask) for layer in backbone.layers)

    ids = INPUT
    shape = g.op("Shape", ids)
    length = g.op("Gather", shape, g.const(1, np.int64), axis=0)  # L, a scalar
    columns = g.op("Range", g.const(0, np.int64), length, g.const(1, np.int64))  # (L,)
    real = g.op("Not", g.op("Equal", ids, g.const(PAD_ID, np.int32)))  # (B, L) bool
    if documents:  # each packed document has its own id, attention and positions
        starts = g.op("Cast", g.op("Or", g.op("Equal", ids, g.const(CLS_ID, np.int32)),
                                   g.op("Equal", ids, g.const(BOS_ID, np.int32))),
                      to=TensorProto.INT64)
        doc = g.op("Where", real, g.op("Add", g.op("CumSum", starts, g.const(1, np.int64)),
                                       g.const(1, np.int64)), g.const(0, np.int64))  # (B, L)
        same = g.op("Equal", g.op("Unsqueeze", doc, g.const([2], np.int64)),
                    g.op("Unsqueeze", doc, g.const([1], np.int64)))  # (B, L, L)
        earlier = g.op("Greater", g.op("Unsqueeze", columns, g.const([1], np.int64)),
                       g.op("Unsqueeze", columns, g.const([0], np.int64)))  # (L, L): j < i
        within = g.op("ReduceSum", g.op("Cast", g.op("And", same, earlier), to=TensorProto.INT64),
                      g.const([-1], np.int64), keepdims=0)  # (B, L)
        positions = g.op("Where", real, within, g.op("Unsqueeze", columns,
                                                     g.const([0], np.int64)))
        pad_query = g.op("Unsqueeze", g.op("Not", real), g.const([2], np.int64))  # (B, L, 1)
        visible = g.op("And", g.op("Unsqueeze", real, g.const([1], np.int64)),
                       g.op("Or", same, pad_query))  # (B, L, L)
        visible = g.op("Unsqueeze", visible, g.const([1], np.int64))  # (B, 1, L, L)
    else:
        positions = columns
        visible = g.op("Unsqueeze", real, g.const([1, 2], np.int64))  # (B, 1, 1, L)

    tokens = g.op("Gather", g.const(embedding.token_embedding.get_weights()[0],
                                    name="embeddings.token"), ids, axis=0)  # (B, L, H)
    x = g.op("Add", tokens, g.op("Gather", g.const(
        embedding.position_embedding.get_weights()[0], name="embeddings.position"),
        positions, axis=0))
    if blocks and blocks[0].norm == "post":
        x = g.layer_norm(x, backbone.get_layer("embeddings_norm"), "embeddings_norm")
    if blocks and blocks[0].causal:  # every block of a causal encoder is causal: one mask
        earlier_or_self = g.op("GreaterOrEqual",
                               g.op("Unsqueeze", columns, g.const([1], np.int64)),
                               g.op("Unsqueeze", columns, g.const([0], np.int64)))  # j <= i
        visible = g.op("And", visible, earlier_or_self)
    for i, block in enumerate(blocks):
        x = _block(g, x, block, visible, f"block_{i}")
    if blocks and blocks[0].norm == "pre":
        x = g.layer_norm(x, backbone.get_layer("final_norm"), "final_norm")

    if isinstance(pool, MaskedMeanPooling):
        mask = g.op("Unsqueeze", real, g.const([-1], np.int64))  # (B, L, 1)
        kept = g.op("Where", mask, x, g.const(0.0))
        count = g.op("ReduceSum", g.op("Cast", mask, to=TensorProto.FLOAT),
                     g.const([1], np.int64), keepdims=0)  # (B, 1)
        pooled = g.op("Div", g.op("ReduceSum", kept, g.const([1], np.int64), keepdims=0),
                      g.op("Max", count, g.const(1.0)))
    elif isinstance(pool, ClsPooling):
        pooled = g.op("Gather", x, g.const(0, np.int64), axis=1)  # (B, H)
    else:  # LastTokenPooling: the last real position of a right-padded row
        count = g.op("ReduceSum", g.op("Cast", real, to=TensorProto.INT64),
                     g.const([1], np.int64), keepdims=1)  # (B, 1)
        last = g.op("Max", g.op("Sub", count, g.const([1], np.int64)), g.const([0], np.int64))
        index = g.op("Expand", g.op("Unsqueeze", last, g.const([2], np.int64)),
                     g.op("Concat", g.op("Slice", g.op("Shape", x), g.const([0], np.int64),
                                         g.const([1], np.int64)),
                          g.const([1, embedding.hidden], np.int64), axis=0))  # (B, 1, H)
        pooled = g.op("Squeeze", g.op("GatherElements", x, index, axis=1),
                      g.const([1], np.int64))
    logits = g.dense(pooled, head, "head_logits")
    g.nodes.append(helper.make_node("Identity", [logits], [LOGITS]))
    g.nodes.append(helper.make_node("Softmax", [LOGITS], [PROBABILITIES], axis=-1))
    classes = int(head.get_weights()[1].shape[0])
    graph = helper.make_graph(
        g.nodes, "selfsup_classifier",
        [helper.make_tensor_value_info(INPUT, TensorProto.INT32, ["batch", "length"])],
        [helper.make_tensor_value_info(LOGITS, TensorProto.FLOAT, ["batch", classes]),
         helper.make_tensor_value_info(PROBABILITIES, TensorProto.FLOAT, ["batch", classes])],
        g.initializers)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="selfsup")
    proto.ir_version = 8  # readable by every ONNX Runtime since 1.11
    g.onnx.checker.check_model(proto)
    return proto


def _block(g: _Graph, x: str, block, visible: str, name: str) -> str:
    """One `TransformerEncoderBlock` at inference."""
    hidden, heads = block.hidden, block.heads
    head_dim = hidden // heads

    def attention(h: str) -> str:
        qkv = g.op("Reshape", g.dense(h, block.qkv, f"{name}.qkv"),
                   g.const([0, 0, 3, heads, head_dim], np.int64))  # (B, L, 3, N, D)
        q, k, v = (g.op("Transpose", g.op("Gather", qkv, g.const(j, np.int64), axis=2),
                        perm=[0, 2, 1, 3]) for j in range(3))  # (B, N, L, D) each
        scores = g.op("Div", g.op("MatMul", q, g.op("Transpose", k, perm=[0, 1, 3, 2])),
                      g.const(math.sqrt(head_dim)))  # (B, N, L, L)
        probs = g.op("Softmax", g.op("Where", visible, scores, g.const(-1e9)), axis=-1)
        mixed = g.op("Reshape", g.op("Transpose", g.op("MatMul", probs, v), perm=[0, 2, 1, 3]),
                     g.const([0, 0, hidden], np.int64))  # (B, L, H)
        return g.dense(mixed, block.attention_output, f"{name}.attention_output")

    def feed_forward(h: str) -> str:
        return g.dense(g.gelu_tanh(g.dense(h, block.ff_in, f"{name}.ff_in")), block.ff_out,
                       f"{name}.ff_out")

    if block.norm == "post":
        x = g.layer_norm(g.op("Add", x, attention(x)), block.attention_norm,
                         f"{name}.attention_norm")
        return g.layer_norm(g.op("Add", x, feed_forward(x)), block.ff_norm, f"{name}.ff_norm")
    x = g.op("Add", x, attention(g.layer_norm(x, block.attention_norm, f"{name}.attention_norm")))
    return g.op("Add", x, feed_forward(g.layer_norm(x, block.ff_norm, f"{name}.ff_norm")))


class OnnxScorer:
    """ids (N, L) int32 -> class logits (N, C) through ONNX Runtime, `batch_size` rows a call."""

    def __init__(self, model: bytes | str | Path, threads: int | None = None):
        try:
            import onnxruntime as ort
        except ImportError:
            raise UserError("the onnx engine needs onnxruntime: pip install -e '.[export]'"
                            ) from None
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        source = model if isinstance(model, bytes) else str(model)
        self.session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])

    def __call__(self, ids: np.ndarray, batch_size: int = 256) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int32)
        out = [self.session.run([LOGITS], {INPUT: ids[i : i + batch_size]})[0]
               for i in range(0, len(ids), batch_size)]
        classes = self.session.get_outputs()[0].shape[-1]
        return np.concatenate(out) if out else np.zeros((0, classes), np.float32)


def onnx_bundle_names(out: Path) -> tuple[Path, Path, Path]:
    """(model, spec, tokenizer) paths of an ONNX export at `out` (a .onnx file): the spec and the
    tokenizer sit beside it, named after it."""
    if out.suffix != ".onnx":
        raise UserError(f"--out for the onnx format is a .onnx file, got {str(out)!r}")
    return out, out.with_suffix(".json"), out.with_name(f"{out.stem}.tokenizer.json")


def write_onnx_bundle(bundle, out: str | Path, source: dict[str, Any]) -> list[Path]:
    """`bundle`'s classifier as `out` (.onnx) with its spec and tokenizer beside it, in the
    layout `ClassifierBundle.load(out.parent, spec_file=...)` reads: the classifier's labels,
    encode settings, length, framing and window reading, and the sha256 of both files. The
    spec is written last: until it is, the two files are not a bundle."""
    model_path, spec_path, tokenizer_path = onnx_bundle_names(Path(out))
    atomic_write_bytes(model_path, classifier_onnx(bundle.model).SerializeToString())
    tokenizer_file = bundle.spec.get("tokenizer_file", "tokenizer.json")
    with atomic_path(tokenizer_path) as tmp:
        shutil.copyfile(bundle.directory / tokenizer_file, tmp)
    spec = {k: v for k, v in bundle.spec.items() if k != "sha256"}
    atomic_write_json(spec_path, {
        **spec, "model_file": model_path.name, "tokenizer_file": tokenizer_path.name,
        "onnx": {"opset": OPSET, "input": f"{INPUT} (batch, length) int32, right-padded with "
                                          f"[PAD] ({PAD_ID})",
                 "outputs": [f"{LOGITS} (batch, classes)", f"{PROBABILITIES} (batch, classes)"],
                 "per": "window: a document's probabilities are the mean of its windows'"},
        "exported_from": source,
        "sha256": {p.name: sha256_file(p) for p in (model_path, tokenizer_path)}})
    return [model_path, spec_path, tokenizer_path]


def export_onnx(workdir: str | Path, out: str | Path) -> list[Path]:
    """The kept classifier of a finished run (checked against its manifests first) as an ONNX
    bundle at `out` (`write_onnx_bundle`)."""
    from selfsup_model.serving.inference import CLASSIFIER_FILE, load_run_classifier

    bundle = load_run_classifier(workdir)
    source = {"workdir": str(Path(workdir).resolve()),
              f"finetune/{CLASSIFIER_FILE}": sha256_file(bundle.directory / CLASSIFIER_FILE)}
    return write_onnx_bundle(bundle, out, source)
