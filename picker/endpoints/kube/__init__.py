"""Kubernetes discovery in four parts, one job each (`picker.endpoints.kubernetes` re-exports the names):

- `credentials`, `kubeconfig`: whom to talk to and as whom; rotating or expiring tokens are fetched again.
- `client`: the REST calls (GET, LIST, WATCH from a resourceVersion), typed errors, malformed objects skipped.
- `objects`: InferencePool → selector and ports, pod → endpoints, InferenceObjectives → priorities (pure).
- `discovery`: the loops that follow the cluster, retrying transient errors with backoff and nothing else.
"""
