"""End-to-end tests of Tandem on a real Kubernetes control plane (etcd, apiserver, KWOK)."""
