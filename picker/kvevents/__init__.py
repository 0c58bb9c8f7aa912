"""vLLM's KV-cache events, read by the picker: the event records and their wire decoding (`events`), the ZMQ
subscriber that follows every pod's stream in order (`subscriber`), the relay that shares what a bound socket
receives with the other replicas through Redis (`relay`), and the per-pod view of what each cache
holds, keyed by our own hash of the token ids (`picker.prefix.precise`)."""
