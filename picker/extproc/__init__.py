"""The Envoy ext_proc side: the gRPC servicer state machine and the protocol messages it sends."""
