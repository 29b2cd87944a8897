"""The frozen 0.1 plugin's tests run only installed, through check.sh, never in the core's suite."""

collect_ignore_glob = ["pageblob-0.1/*"]
