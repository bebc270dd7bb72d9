"""The KV-aware prefill/decode router: discovery → prefix index → scoring → P/D proxy → admission."""
