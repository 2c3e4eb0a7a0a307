# The scripts are programs launched by test_scripts.py on 2 ranks, not test modules.
collect_ignore_glob = ["scripts/*"]
