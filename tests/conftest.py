"""Shared test set-up: this folder is on sys.path, so every suite can import `tandem_process`."""
