"""A media server for m3c serve's fetch-rule tests: serves one image at
/image.png and redirects /redirect?to=URL, counts every request it gets
(GET /count answers the count of the others), and prints its URL once it
listens.

    python media_server.py HOST PORT IMAGE
"""

import http.server
import sys
import threading
import urllib.parse

host, port, image = sys.argv[1], int(sys.argv[2]), open(sys.argv[3], "rb").read()
count = 0
lock = threading.Lock()


class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        global count
        url = urllib.parse.urlparse(self.path)
        if url.path == "/count":
            body = str(count).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        with lock:
            count += 1
        if url.path == "/image.png":
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(image)))
            self.end_headers()
            self.wfile.write(image)
        elif url.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", urllib.parse.parse_qs(url.query)["to"][0])
            self.send_header("Content-Length", "0")
            self.end_headers()
        else:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()


srv = http.server.ThreadingHTTPServer((host, port), Handler)
srv.daemon_threads = True
print(f"http://{host}:{srv.server_address[1]}", flush=True)
srv.serve_forever()
