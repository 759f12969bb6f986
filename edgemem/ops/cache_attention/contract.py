"""The CacheAttention contract. `edgemem::CacheAttention`: T new tokens of B streams attend a
fixed-size cache of L slots.

Slots and positions. Each row b continues at its own absolute position p_b (int64 `position`
[B]). With `sinks` = −1 (a linear cache) the token at position a lives in slot a, and p_b + T ≤ L
is the caller's to ensure (the runtime refuses more with `CacheFullError`). With `sinks` = S ≥ 0
(a sliding window with attention sinks, StreamingLLM) the first S tokens keep slots 0..S−1 and
token a ≥ S lives in ring slot S + (a − S) mod R, R = L − S: a query at p sees the sinks and the
last R tokens p − R + 1 … p (itself included), i.e. the cache as it is after writing p.

Queries. `query` scores the keys outside the sinks, `sink_query` the S sink slots (the layer
rotates them at different positions, see SoftmaxAttention); for a linear cache pass `query`
twice. Keys are scored by one softmax over every visible slot. GQA: head h reads K/V head
h // (num_heads / kv_num_heads).

    query, sink_query [B, T, H*D]; key, value [B, T, H_kv*D]; past_key, past_value [B, H_kv, L, D]
    (float32 state whatever the query dtype); position [B] int64
    → output [B, T, H*D] (query dtype), present_key, present_value [B, H_kv, L, D]: the cache
      after the T tokens (a block longer than the ring writes each slot once, with its newest token).
"""

from edgemem.opset import Attribute

OP_TYPE = "CacheAttention"
INPUTS = ("query", "key", "value", "past_key", "past_value", "position", "sink_query")
OUTPUTS = ("output", "present_key", "present_value")
ATTRIBUTES = {
    "num_heads": Attribute("int"),
    "kv_num_heads": Attribute("int"),
    "sinks": Attribute("int"),
    "scale": Attribute("float"),
}
