"""A real Kubernetes control plane without containers: built binaries, fresh PKI, KWOK nodes."""
