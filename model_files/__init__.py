"""The model files model.py's `load_model` reads beside a Hugging Face folder: a GGUF file converted
once and cached (gguf); what --model accepts, checked before anything loads (names)."""
