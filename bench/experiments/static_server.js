// The benchmark site served by Node's HTTP server, for engine_overheads.py's `--server node`: whether the
// Python fixture server's CPU on the same two cores holds the engine back. Files are read once and held in
// memory; keep-alive and TCP_NODELAY as the fixture; a missing file is a 404. Leaves when stdin ends.
//     node static_server.js <folder>      (prints its base URL)
const http = require("http");
const fs = require("fs");
const path = require("path");

const root = path.resolve(process.argv[2]);
const held = new Map();  // URL path -> Buffer, or null: not a file under root
const types = { ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".png": "image/png" };

function file(rel) {
  if (!held.has(rel)) {
    const full = path.join(root, rel);
    let data = null;
    try {
      if (full.startsWith(root + path.sep) && fs.statSync(full).isFile()) data = fs.readFileSync(full);
    } catch (e) { /* missing: null */ }
    held.set(rel, data);
  }
  return held.get(rel);
}

const server = http.createServer((req, res) => {
  let rel;
  try { rel = decodeURIComponent(req.url.split("?")[0]); } catch (e) { rel = "/"; }
  const data = file(rel);
  if (data === null) {
    res.writeHead(404, { "Content-Type": "text/plain", "Content-Length": 9 });
    res.end("Not Found");
    return;
  }
  res.writeHead(200, { "Content-Type": types[path.extname(rel).toLowerCase()] || "application/octet-stream",
                       "Content-Length": data.length });
  res.end(data);
});
server.keepAliveTimeout = 60000;
server.on("connection", (sock) => sock.setNoDelay(true));
server.listen(0, "127.0.0.1", () => console.log(`http://127.0.0.1:${server.address().port}`));
process.stdin.on("end", () => process.exit(0));
process.stdin.resume();
