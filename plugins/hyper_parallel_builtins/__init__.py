"""The plugins that ship with hyper_parallel.

Each module is one plugin, declared in the ``hyper_parallel`` entry-point
group of this distribution and discovered exactly like a third party's.
Nothing in :mod:`hyper_parallel.core` imports these modules by path.
"""
