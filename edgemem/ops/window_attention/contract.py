"""The WindowAttention contract: the node's name, inputs, outputs and attributes (onnx.py has the
details); its argument checks are BandedAttention's (`edgemem.ops.banded_attention.contract`)."""

from edgemem.opset import Attribute

OP_TYPE = "WindowAttention"
INPUTS = (
    "query", "key", "value", "past_key", "past_value", "position", "persistent_key", "persistent_value",
)  # fmt: skip
OUTPUTS = ("output", "present_key", "present_value")
ATTRIBUTES = {
    "num_heads": Attribute("int"),
    "window": Attribute("int"),
    "dilation": Attribute("ints"),
    "scale": Attribute("float"),
}
