"""Kubernetes discovery: the pods of an InferencePool (or of a label selector) become the picker's endpoints.

LIST, then WATCH from the list's resourceVersion (a 410 Gone relists; a closed stream re-watches), over the API
server's REST interface with the pod's service account (in cluster) or a kubeconfig; no client library needed.
Only Running, Ready pods with an IP and no deletion timestamp count. Each of the pool's target ports on a pod is one
endpoint (data-parallel ranks behind one pod IP). In InferencePool mode the pool object is watched too: a changed
selector or port list re-reads the pods, a deleted pool empties the set until it comes back.

Tokens are fetched per request: the service-account token file is re-read once a minute (bound tokens rotate)
and after a 401; kubeconfig `exec` credential plugins are run again when their token expires or is refused.
Only transient errors (network, timeouts, API refusals) are retried, with jittered backoff; a malformed object
is skipped; a bug ends the loop loudly. The work lives in `picker.endpoints.kube` (see its modules); this
module is the entry point the rest of the picker imports from.
"""

from picker.endpoints.kube.client import (
    TRANSIENT,
    WATCH_TIMEOUT_SECONDS,
    Gone,
    KubeApi,
    KubeError,
    WatchEvent,
)
from picker.endpoints.kube.credentials import (
    TOKEN_MAX_AGE,
    Credentials,
    CredentialsError,
    ExecCredentials,
    ExecPlugin,
    StaticToken,
    TokenFile,
    parse_exec_credential,
)
from picker.endpoints.kube.discovery import (
    OBJECTIVE_GROUP,
    OBJECTIVE_VERSION,
    POOL_GROUP,
    POOL_VERSION,
    REWRITE_GROUP,
    REWRITE_VERSION,
    KubernetesDiscovery,
    follow_collection,
    watch_model_rewrites,
    watch_objectives,
)
from picker.endpoints.kube.kubeconfig import SERVICE_ACCOUNT, KubeConfig, load_kube_config
from picker.endpoints.kube.objects import (
    MalformedObject,
    PoolSpec,
    label_selector,
    model_rewrite_rules,
    objective_priorities,
    pod_endpoints,
    pool_spec,
)

__all__ = [
    "OBJECTIVE_GROUP", "OBJECTIVE_VERSION", "POOL_GROUP", "POOL_VERSION", "REWRITE_GROUP", "REWRITE_VERSION",
    "SERVICE_ACCOUNT", "TOKEN_MAX_AGE",
    "TRANSIENT", "WATCH_TIMEOUT_SECONDS", "Credentials", "CredentialsError", "ExecCredentials", "ExecPlugin",
    "Gone", "KubeApi", "KubeConfig", "KubeError", "KubernetesDiscovery", "MalformedObject", "PoolSpec",
    "StaticToken", "TokenFile", "WatchEvent", "follow_collection", "label_selector",
    "load_kube_config", "model_rewrite_rules", "objective_priorities", "parse_exec_credential", "pod_endpoints",
    "pool_spec", "watch_model_rewrites", "watch_objectives",
]
