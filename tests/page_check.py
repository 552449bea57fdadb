#!/usr/bin/python3
"""The live status page in a real browser (issue 25): an example runs a job with --metrics;
while it runs, /status.json is validated against docs/status.schema.json (python3-jsonschema)
and GET / is rendered by headless Chromium (Debian `chromium`): the DOM must hold the producers'
devices and the running job's progress bar, and the screenshot must not be blank.

usage: page_check.py EXAMPLE SCHEMA [SCREENSHOT_OUT]
Exits 77 (skipped) when chromium or jsonschema is missing. Chromium reaches loopback only:
every other host name resolves to nothing (--host-resolver-rules) and no background service runs.
"""
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
import zlib

SKIP = 77


def skip(why):
    print("skipped: " + why)
    sys.exit(SKIP)


def fail(why):
    print("FAILED: " + why)
    sys.exit(1)


def png_pixels(path):
    """Decodes an 8-bit RGB/RGBA, non-interlaced PNG (what Chromium writes): rows of bytes."""
    data = open(path, "rb").read()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        fail(path + " is not a PNG")
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", body)
            if depth != 8 or color not in (2, 6) or interlace:
                fail("unexpected PNG format: depth %d color %d interlace %d" % (depth, color, interlace))
            bpp = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = width * bpp
    rows, prev = [], bytearray(stride)
    for y in range(height):
        f = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b = prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return width, height, bpp, rows


def main():
    if len(sys.argv) < 3:
        fail("usage: page_check.py EXAMPLE SCHEMA [SCREENSHOT_OUT]")
    example, schema_path = sys.argv[1], sys.argv[2]
    shot_out = sys.argv[3] if len(sys.argv) > 3 else None
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if not browser:
        skip("no chromium (Debian package `chromium`; tools/setup.sh installs it)")
    try:
        import jsonschema
    except ImportError:
        skip("no python3-jsonschema (tools/setup.sh installs it)")
    schema = json.load(open(schema_path))

    work = tempfile.mkdtemp()
    err = open(os.path.join(work, "err"), "w+")
    # About 100 s of work (far more than the checks take); ended once the page is checked.
    proc = subprocess.Popen([example, "--devices", "cpu,cpu", "--items", "200000", "--work-ms", "1",
                             "--power", "2",
                             "--metrics", "127.0.0.1:0", "--progress", "off"],
                            stdout=subprocess.DEVNULL, stderr=err)
    try:
        url = None
        for _ in range(300):
            err.seek(0)
            m = re.search(r"metrics on (http://127\.0\.0\.1:\d+/)", err.read())
            if m:
                url = m.group(1)
                break
            if proc.poll() is not None:
                break
            time.sleep(0.05)
        if not url:
            err.seek(0)
            fail("the example did not say where its metrics are:\n" + err.read())

        # 1. /status.json while the job runs: valid against the schema, the job listed.
        status = None
        for _ in range(400):
            status = json.loads(urllib.request.urlopen(url + "status.json", timeout=10).read())
            jsonschema.validate(status, schema)
            jobs = [j for r in status["runners"] for j in r["jobs"]]
            if jobs and jobs[0]["done"] > 0:
                break
            time.sleep(0.05)
        else:
            fail("no running job with items done in /status.json: " + json.dumps(status))
        job = jobs[0]
        if job["total"] != 200000:
            fail("the job's total is %r, not 200000" % job["total"])
        print("status.json valid against %s while job %d runs (%d/%d)" %
              (os.path.basename(schema_path), job["id"], job["done"], job["total"]))

        # 2. The page rendered by Chromium: producers and the job's progress in the DOM.
        profile = os.path.join(work, "profile")
        common = [browser, "--headless", "--no-sandbox", "--disable-gpu",
                  "--disable-dev-shm-usage", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--disable-extensions",
                  "--disable-default-apps", "--user-data-dir=" + profile,
                  "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
                  # the page polls every second: two polls so that rates and the sparkline show
                  "--virtual-time-budget=2500", "--window-size=1000,700"]
        def still_running():
            if proc.poll() is not None:
                fail("the example ended (exit %r) before the page was checked" % proc.returncode)

        still_running()
        dom = subprocess.run(common + ["--dump-dom", url], capture_output=True, text=True,
                             timeout=120)
        if dom.returncode != 0:
            fail("chromium --dump-dom exited %d:\n%s" % (dom.returncode, dom.stderr[-2000:]))
        html = dom.stdout
        still_running()  # the DOM is of a page whose job was running
        for needle, what in [("<h2>runner ", "a runner's heading"),
                             ("<td>cpu</td>", "a producer's device"),
                             ('class="job"', "a running job's row"),
                             ('class="progress"', "a progress bar"),
                             ("/200000</td>", "the job's done/total"),
                             ("<polyline", "the throughput sparkline")]:
            if needle not in html:
                fail("the rendered page has no %s (%r):\n%s" % (what, needle, html[-3000:]))
        producers = re.findall(r"<tr[^>]*><td>(\d+)</td><td>cpu</td><td>(up)</td>", html)
        if len(producers) != 2:
            fail("expected 2 producers up on the page, found %r" % producers)
        pct = re.search(r'class="progress"><span style="width:([0-9.]+)%"></span></span> (\d+)%',
                        html)
        if not pct:
            fail("no progress percentage in the job's row")
        print("rendered DOM: 2 producers (cpu, up), job progress %s%%, sparkline" % pct.group(2))

        # 3. A screenshot that is not blank: many colours, and the progress bar's blue.
        still_running()
        shot = os.path.join(work, "page.png")
        # a longer look (virtual time) for a sparkline of several samples
        r = subprocess.run(common + ["--virtual-time-budget=6500", "--screenshot=" + shot, url],
                           capture_output=True,
                           text=True, timeout=120)
        if r.returncode != 0 or not os.path.exists(shot):
            fail("chromium --screenshot exited %d:\n%s" % (r.returncode, r.stderr[-2000:]))
        width, height, bpp, rows = png_pixels(shot)
        colours = set()
        blue = 0
        for row in rows:
            for x in range(0, width * bpp, bpp):
                px = row[x:x + 3]
                colours.add(px)
                blue += px == b"\x44\x88\xcc"
        if len(colours) < 8:
            fail("the screenshot is blank (%d colours)" % len(colours))
        if blue == 0:  # the bar's colour only (the sparkline is #22aa66)
            fail("no progress-bar pixel (#4488cc) in the screenshot")
        print("screenshot %dx%d: %d colours, %d progress-bar pixels" % (width, height,
                                                                       len(colours), blue))
        if shot_out:
            shutil.copyfile(shot, shot_out)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(work, ignore_errors=True)
    print("ok")


if __name__ == "__main__":
    main()
