"""Publish a training state at a step; fetch it from one or several holders, verified.

::

    pub = collective.publish(model.state_dict(), step=8)          # serves at pub.address
    state = collective.fetch([a.address, b.address], step=8)      # striped over both, verified
    pub.close()

``publish(state, *, step, token=None, bind="0.0.0.0:0", advertise=None, copy=False,
chunk_bytes=None, tls=None) -> Publication``: ``state`` is a mapping name -> array (numpy array or CPU
torch tensor), or a nested ``state_dict`` / optimizer ``state_dict()``; tensors are served as
raw bytes, other leaves (int, float, bool, None, str and lists / dicts / tuples of them) as
JSON; anything else is a UsageError naming its key path. Nothing is pickled. Every digest is
computed once, here. ``copy=False`` serves the caller's arrays in place: do not change them
until ``close()`` returns. ``copy=True`` serves a copy (a sealed memory file, which a fetcher
on the same host maps instead of streaming), and the caller may change them at once.

``fetch(sources, *, step, token=None, timeout=300.0, stall_timeout=30.0, into=None,
manifest=None, max_bytes=None, tls=None, shm=True) -> Fetched`` (a dict): the state as published, tensors as numpy
arrays (views of one received arena, or the caller's ``into`` arrays: name -> preallocated
writable array of the tensor's shape and dtype, so a recovering process holds the state once),
other leaves as their JSON values. Several sources: the holders of ``step`` whose manifests
agree share the work, stripe by stripe; a holder lost or lying is dropped and its share taken
from the others. ``manifest``: the manifest digest the state must have (from a source trusted
more than the holders). Errors: ``FetchError`` (wrong step, disagreeing holders, no holder left),
``IntegrityError`` (a holder's bytes differ from its own plan, no other holder left), ``AuthError``,
``ChiefUnreachableError`` (a holder unreachable), ``ProtocolError`` (a hostile plan or
structure), ``DeadlineError``; each one line naming the holder.

``subscribe(sources, *, token=None, into=None, timeout=300.0, stall_timeout=30.0, tls=None,
auto=False) -> Subscription``: follow a publication whose steps come from
``Publication.update(state, step)``: each step's element-level delta received, checked, applied
in place by ``Subscription.apply()`` and verified against the step's digests.

The docs' pages "Publish and fetch" and "Every step" say what is verified and what is not.
"""

from collective.errors import FetchError
from collective.snapshot.fetcher import Fetched, fetch
from collective.snapshot.holder import Publication, publish
from collective.snapshot.subscriber import Subscription, subscribe

__all__ = ["publish", "fetch", "subscribe", "Publication", "Subscription", "Fetched", "FetchError"]
