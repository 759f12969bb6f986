"""Layers following the stateful protocol (`edgemem.layers.base.StatefulLayer`)."""

from edgemem.layers.aft import AFT
from edgemem.layers.base import State, StatefulLayer
from edgemem.layers.delta_rnn import DeltaRNN
from edgemem.layers.deltanet import DeltaNet, GatedDeltaNet
from edgemem.layers.gau import GAU
from edgemem.layers.hope import HOPE, CMSLevel, SelfModifyingMemory
from edgemem.layers.linear_attention import LinearAttention
from edgemem.layers.liza import LiZA
from edgemem.layers.longformer import BandedEncoderAttention, SlidingWindowAttention
from edgemem.layers.softmax_attention import SoftmaxAttention
from edgemem.layers.titans import NeuralMemoryLayer, TitansMAC, TitansMAG, TitansMAL

__all__ = [
    "AFT",
    "GAU",
    "HOPE",
    "BandedEncoderAttention",
    "CMSLevel",
    "DeltaNet",
    "DeltaRNN",
    "GatedDeltaNet",
    "LinearAttention",
    "LiZA",
    "NeuralMemoryLayer",
    "SelfModifyingMemory",
    "SlidingWindowAttention",
    "SoftmaxAttention",
    "State",
    "StatefulLayer",
    "TitansMAC",
    "TitansMAG",
    "TitansMAL",
]
