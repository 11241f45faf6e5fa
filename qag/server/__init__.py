"""The process side, in gunicorn's vocabulary: `serve` configures gunicorn and starts the arbiter; `arbiter`
holds the shared segment's life and supervises the recorder, the change watcher and the plane; `gworker` is the
worker class (the event loop and its thread pools); `worker` builds one worker's application after fork;
`changes` is the change watcher (other hosts' changes reach this host's generations). It serves qag/http; nothing
in qag/http imports it back."""
