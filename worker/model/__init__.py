import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a model hub is never reached at run time, whatever is imported first
