"""The plugin contract and its machinery: the hook specs, the registry, the implementation base class, the one
dispatcher and ``auto``'s rule, the core's own registrations, plugin sources and the API's versions.
"""
