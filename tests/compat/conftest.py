"""The frozen plugins' own code and tests run only installed, through check.sh, never in the core's suite."""

collect_ignore_glob = ["pageblob-0.1/*", "pageblob-0.3/*", "blobstore-0.2/*"]
