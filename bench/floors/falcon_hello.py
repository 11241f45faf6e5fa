"""The hello-world floor: a bare Falcon app on gunicorn answering /health and /hello, so the bench can
show what gunicorn + Falcon cost before any database or governance work (bench/README.md)."""
import falcon

_BODY = b'{"status": "ok"}'


class _Hello:
    def on_get(self, req, resp):
        resp.data = _BODY
        resp.content_type = falcon.MEDIA_JSON


app = falcon.App()
app.add_route('/health', _Hello())
app.add_route('/hello', _Hello())
