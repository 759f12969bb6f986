"""Layers following the stateful protocol (`edgemem.layers.base.StatefulLayer`)."""

from edgemem.layers.base import State, StatefulLayer
from edgemem.layers.deltanet import DeltaNet, GatedDeltaNet
from edgemem.layers.linear_attention import LinearAttention
from edgemem.layers.softmax_attention import SoftmaxAttention

__all__ = ["DeltaNet", "GatedDeltaNet", "LinearAttention", "SoftmaxAttention", "State", "StatefulLayer"]
