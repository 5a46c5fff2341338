"""The backends that run the forward pass under ``lily.Model`` (docs/architecture.md, "Backends").

``metal``: the compiled engine (``lily._ext``); the ``reference`` backend is ``lily.reference.ReferenceModel``,
the specification itself.
"""
