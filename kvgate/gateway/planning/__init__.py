"""Planning one request: its prompt as token ids (tokenizer, chat templates, the prompt window),
its block keys looked up in the store and the engines' KV events, and the scheduler's decision.
"""
