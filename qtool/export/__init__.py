"""Writing a qtool checkpoint in another library's format, so that clients without qtool (transformers, vLLM)
load it: one module per target format, each refusing the schemes its format cannot hold."""
