"""The Envoy front door: kvgate as the endpoint picker (EPP) of the Gateway API Inference Extension.

Envoy's ext_proc filter streams each request to `ExternalProcessor.Process` (FULL_DUPLEX_STREAMED
bodies). kvgate buffers the request body, plans it with the very planner the HTTP front door uses,
names the chosen engine in `x-gateway-destination-endpoint` (header and `envoy.lb` metadata) and
streams the body back; Envoy forwards to that engine. Answers pass back through the picker
unchanged, which closes the loop (account, TTFT model, hit accounting, outliers) in the shared core.

- messages.py: every ext_proc message kvgate reads or writes (the only module that knows the protos);
- exchange.py: one request's way through the picker, from its headers to its answer's end;
- server.py: the gRPC service, its health, and the HTTP side (metrics, debug, admin routes).
"""
