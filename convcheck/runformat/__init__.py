"""The run formats on disk, below both the watch and ``bundle/``: what a watched run's folder holds and how it is
read untrusted, and the field checks and members both kinds of run share.

``schema`` (both formats' versions and limits), ``fields`` (a field checked: kind, shape, dtype, SHA-256) and
``members`` (a run's files read safely, a folder or a zip), ``layout`` (a watched run's files and the folder's
rules), ``reader`` (a watched run read and checked), ``ranks`` (a DDP run's rank folders), ``by_value`` (the model
kept by value, signed, and torch's own layers as safe data)."""
