"""The request path above the scheduler: the director's steps (`director`) and the admission gates
(`admission`; flow control, the other gate, is `picker.flowcontrol`).

May import `core`, `endpoints`, `prefix`, `kvevents`, `scheduling` and `flowcontrol`; never `extproc`, `api`,
`serving` or the tools. What it reports (metrics, traces) goes to observer interfaces it declares.
"""
