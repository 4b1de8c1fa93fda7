"""The HTTP/OpenAI front door: kvgate is the proxy. The aiohttp app and server, forwarding with retries,
prefill/decode pairs through the protocols' hand-offs, the SSE relay, client auth, timeouts and drain.
"""
