"""Every span, event and attribute name kvgate writes, documented in docs/OPERATIONS.md ("Tracing").

Names follow OpenTelemetry's semantic conventions where they have one (http.*, server.*, client.*,
gen_ai.*, error.type); the rest are kvgate's own, prefixed `kvgate.`. This module imports nothing, so
the request path names its spans without loading OpenTelemetry.
"""

# Span names.
TOKENIZE = "kvgate.tokenize"
LOOKUP = "kvgate.lookup"
SCHEDULE = "kvgate.schedule"
FORWARD = "kvgate.forward"
PREFILL = "kvgate.prefill"
DECODE = "kvgate.decode"
# Events on an attempt's span.
FIRST_BYTE = "kvgate.first_byte"

# Semantic conventions.
HTTP_METHOD = "http.request.method"
HTTP_ROUTE = "http.route"
HTTP_STATUS = "http.response.status_code"
URL_PATH = "url.path"
CLIENT_ADDRESS = "client.address"
USER_AGENT = "user_agent.original"
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"
ERROR_TYPE = "error.type"
GEN_AI_OPERATION = "gen_ai.operation.name"
GEN_AI_MODEL = "gen_ai.request.model"
GEN_AI_MAX_TOKENS = "gen_ai.request.max_tokens"
# kvgate's own.
REQUEST_ID = "kvgate.request_id"
FRONT_DOOR = "kvgate.front_door"
STREAM = "kvgate.stream"
PROMPT_TOKENS = "kvgate.prompt_tokens"
PROMPT_TOKENS_ESTIMATED = "kvgate.prompt_tokens_estimated"
BLOCKS = "kvgate.blocks"
KVS_STATUS = "kvgate.kvs.status"
KVS_ELAPSED = "kvgate.kvs.elapsed_s"
EVENTS_STATUS = "kvgate.kv_events.status"
POLICY = "kvgate.policy"
CANDIDATES = "kvgate.candidates"
CACHE_AWARE = "kvgate.cache_aware"
INSTANCE = "kvgate.instance"
RANKING = "kvgate.ranking"
PREFIX_HIT_TOKENS = "kvgate.prefix_hit_tokens"
TTFT_PREDICTED = "kvgate.ttft.predicted_s"
TTFT_QUEUE = "kvgate.ttft.queue_s"
TTFT_PREFILL = "kvgate.ttft.prefill_s"
TTFT_TRANSFER = "kvgate.ttft.transfer_s"
TTFT_TRANSFER_TOKENS = "kvgate.ttft.transfer_tokens"
PD_DECODE_INSTANCE = "kvgate.pd.decode_instance"
PD_SKIP_PREFILL = "kvgate.pd.skip_prefill"
PD_CLUSTER = "kvgate.pd.cluster"
REJECTION_CODE = "kvgate.rejection.code"
ERROR_CODE = "kvgate.error.code"
ATTEMPT = "kvgate.attempt"
OUTCOME = "kvgate.outcome"

# `kvgate.outcome` of a request that has no status to say how it ended.
CLIENT_CLOSED = "client_closed"
CANCELLED = "cancelled"  # an attempt's: its request was cancelled (the client left, or a pair's other half)
STREAM_BROKEN = "stream_broken"
# The ranking's head written on spans (the pick and the fallbacks a retry would take).
RANKING_SHOWN = 4
