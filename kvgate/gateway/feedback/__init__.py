"""What the answers teach the core: the first byte and the end release the account and calibrate
the TTFT model; the engine's usage checks the predicted hit; the PrfaaS link's load.
"""
