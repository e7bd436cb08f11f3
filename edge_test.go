package main

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// /api/slow checks ms before multiplying and caps it at KUMIKO_SLOW_MAX.
func TestSlowEndpointValidatesAndCaps(t *testing.T) {
	env := fastEnv(t, "KUMIKO_SLOW_MAX=1s")
	s := startInProcess(t, env)
	for _, ms := range []string{"18446744073710", "9223372036854775807", "99999999999999999999", "-1", "1001", "abc", "", "1.5"} {
		code, _, body, err := get(t, http.DefaultClient, apiURL(s)+"/api/slow?ms="+ms)
		errBody, _ := body["error"].(map[string]any)
		if err != nil || code != 400 || errBody["code"] != "invalid_ms" {
			t.Errorf("ms=%s: %d %v %v, want 400 invalid_ms", ms, code, body, err)
		}
	}
	if code, _, body, err := get(t, http.DefaultClient, apiURL(s)+"/api/slow?ms=1"); err != nil || code != 200 {
		t.Errorf("ms=1: %d %v %v", code, body, err)
	}
}

// KUMIKO_DEMO_ENDPOINTS=false does not register /api/slow: a JSON 404.
func TestDemoEndpointsOff(t *testing.T) {
	env := fastEnv(t, "KUMIKO_DEMO_ENDPOINTS=false")
	s := startInProcess(t, env)
	code, _, body, err := get(t, http.DefaultClient, apiURL(s)+"/api/slow?ms=1")
	errBody, _ := body["error"].(map[string]any)
	if err != nil || code != 404 || errBody["code"] != "not_found" {
		t.Fatalf("/api/slow with demo endpoints off: %d %v %v", code, body, err)
	}
}

// The dashboard page carries security headers, and its CSP allows exactly its
// own inline script and style (by hash), never 'unsafe-inline'.
func TestDashboardSecurityHeaders(t *testing.T) {
	s := startInProcess(t, fastEnv(t))
	resp, page := getBody(t, apiURL(s)+"/", "")
	h := resp.Header
	csp := h.Get("Content-Security-Policy")
	if h.Get("X-Content-Type-Options") != "nosniff" || h.Get("X-Frame-Options") != "DENY" ||
		h.Get("Referrer-Policy") == "" || csp == "" || strings.Contains(csp, "unsafe-inline") {
		t.Fatalf("dashboard headers: %v", h)
	}
	if strings.Contains(string(page), ` style="`) {
		t.Errorf("the page has a style attribute, which the CSP blocks")
	}
	for _, re := range []string{`(?s)<script>(.*?)</script>`, `(?s)<style>(.*?)</style>`} {
		for _, m := range regexp.MustCompile(re).FindAllSubmatch(page, -1) {
			sum := sha256.Sum256(m[1])
			if hash := "'sha256-" + base64.StdEncoding.EncodeToString(sum[:]) + "'"; !strings.Contains(csp, hash) {
				t.Errorf("CSP %q lacks %s for an inline block", csp, hash)
			}
		}
	}
}

// /api/instance shows a dashboard viewer the state, the phases (no notes: a
// warning can carry an endpoint or error text), the leader and the workers,
// and a storm of requests is a handful of Redis SCANs, not one per request.
func TestInstanceEndpointIsPublicSafeAndCached(t *testing.T) {
	env := fastEnv(t,
		"OTEL_EXPORTER_OTLP_ENDPOINT=http://user:otlp-pass@127.0.0.1:1", // nothing listens: a warning
	)
	s := startInProcess(t, env)
	scans := func() int {
		info, err := s.app.redis.Info(context.Background(), "commandstats").Result()
		if err != nil {
			t.Fatal(err)
		}
		m := regexp.MustCompile(`cmdstat_scan:calls=(\d+)`).FindStringSubmatch(info)
		if m == nil {
			return 0
		}
		n, _ := strconv.Atoi(m[1])
		return n
	}
	before, start := scans(), time.Now()
	var wg sync.WaitGroup
	bodies := make([]string, 50)
	for i := range bodies {
		wg.Go(func() {
			resp, err := http.Get(apiURL(s) + "/api/instance")
			if err != nil {
				t.Error(err)
				return
			}
			raw, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			bodies[i] = string(raw)
		})
	}
	wg.Wait()
	// At most one read per started TTL (1s), whatever the machine's speed;
	// without the cache this is 50 SCANs.
	if n, allowed := scans()-before, int(time.Since(start)/clusterCacheTTL)+1; n > allowed {
		t.Errorf("50 /api/instance requests in %s ran %d SCANs, want at most %d", time.Since(start), n, allowed)
	}
	body := bodies[0]
	for _, leak := range []string{`"note"`, "otlp-pass", "user:", "127.0.0.1:1", "http://", "error"} {
		if strings.Contains(body, leak) {
			t.Errorf("/api/instance contains %q: %s", leak, body)
		}
	}
	for _, want := range []string{`"state":"ready"`, `"phases":[`, `"workers":[`, `"leader":`, `"durationMs"`, `"outcome"`} {
		if !strings.Contains(body, want) {
			t.Errorf("/api/instance lacks %s: %s", want, body)
		}
	}
}

// The limiter keeps at most size buckets (least recently seen IP evicted),
// refuses past the burst with the wait until the next token, and a refused
// request does not use up a future token.
func TestIPRateLimiterIsBoundedAndPerIP(t *testing.T) {
	l := newIPRateLimiter(1, 2, 3)
	now := time.Now()
	for i := range 10 {
		l.reserve("10.0.0."+strconv.Itoa(i), now)
	}
	if n := l.buckets.Len(); n != 3 {
		t.Fatalf("%d buckets for 10 IPs with a bound of 3", n)
	}
	ip := "192.0.2.1"
	for i := range 2 {
		if wait := l.reserve(ip, now); wait != 0 {
			t.Fatalf("request %d within the burst waits %s", i+1, wait)
		}
	}
	for range 5 {
		if wait := l.reserve(ip, now); wait <= 0 || wait > time.Second {
			t.Fatalf("past the burst: wait %s, want (0, 1s]", wait)
		}
	}
	if wait := l.reserve(ip, now.Add(time.Second)); wait != 0 {
		t.Fatalf("one second later (refusals must not have used tokens): wait %s", wait)
	}
	if wait := l.reserve("192.0.2.2", now); wait != 0 {
		t.Fatalf("another IP waits %s", wait)
	}
}

// testCapListener is a capListener on a loopback port, closed at the end of
// the test; its counters are registered nowhere.
func testCapListener(t *testing.T, c connCap) *capListener {
	t.Helper()
	base, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	c.reclaimed = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "reclaimed"}, []string{"state"})
	c.refused = prometheus.NewCounter(prometheus.CounterOpts{Name: "refused"})
	if c.silentGrace == 0 {
		c.silentGrace = time.Hour // no test reaches it unless it sets one
	}
	l := newCapListener(base.(*net.TCPListener), c)
	t.Cleanup(func() { l.Close() })
	return l
}

// dialFrom connects to addr (host:port) from the loopback address from
// (127.0.0.2, …): Linux routes all of 127/8 to the loopback interface, so a
// test plays as many clients as it likes, each with an address of its own.
func dialFrom(t testing.TB, from, addr string) net.Conn {
	t.Helper()
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(from)}, Timeout: 10 * time.Second}
	conn, err := d.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// acceptWithin is the next connection l accepts, failing the test after within.
func acceptWithin(t *testing.T, l *capListener, within time.Duration) net.Conn {
	t.Helper()
	type accepted struct {
		conn net.Conn
		err  error
	}
	done := make(chan accepted, 1)
	go func() {
		c, err := l.Accept()
		done <- accepted{c, err}
	}()
	select {
	case a := <-done:
		if a.err != nil {
			t.Fatal(a.err)
		}
		t.Cleanup(func() { a.conn.Close() })
		return a.conn
	case <-time.After(within):
		t.Fatalf("no connection accepted within %s", within)
		return nil
	}
}

// closedByServer reports whether the server closed conn (end of file or a
// reset) within the given time, rather than leaving it open.
func closedByServer(conn net.Conn, within time.Duration) bool {
	conn.SetReadDeadline(time.Now().Add(within))
	_, err := conn.Read(make([]byte, 1))
	return err != nil && !errors.Is(err, os.ErrDeadlineExceeded)
}

// The connection cap's listener: an Accept waiting for a free slot returns
// as soon as the listener is closed (the drain closes it, possibly at the
// cap), and a connection closed twice gives its slot back once.
func TestCapListenerStopsWaitingWhenClosed(t *testing.T) {
	l := testCapListener(t, connCap{max: 1})
	dialFrom(t, "127.0.0.1", l.Addr().String())
	held := acceptWithin(t, l, 10*time.Second) // takes the only slot
	if _, ok := held.(interface{ SetWriteBuffer(int) error }); !ok {
		t.Errorf("an accepted %T cannot size its send buffer (limitSendBuffer)", held)
	}
	l.track(held, http.StateActive) // in a request: nothing to close to make room

	waiting := make(chan error, 1)
	go func() {
		_, err := l.Accept() // no slot free: waits
		waiting <- err
	}()
	l.Close()
	select {
	case err := <-waiting:
		if !errors.Is(err, net.ErrClosed) {
			t.Errorf("Accept after Close: %v, want net.ErrClosed", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Accept still waits for a slot 10 s after the listener was closed")
	}

	held.Close()
	held.Close()
	if l.open != 0 {
		t.Errorf("%d slots taken after the only connection was closed twice, want 0", l.open)
	}
}

// At the cap, a newcomer takes the slot of the connection idle the longest,
// and only once it is there: idle connections are left alone while nobody
// waits. While every connection is in a request the newcomer waits, and gets
// in as soon as one goes idle.
func TestCapListenerClosesTheLongestIdleForANewcomer(t *testing.T) {
	l := testCapListener(t, connCap{max: 2})
	addr := l.Addr().String()
	first := dialFrom(t, "127.0.0.1", addr)
	a := acceptWithin(t, l, 10*time.Second)
	second := dialFrom(t, "127.0.0.1", addr)
	b := acceptWithin(t, l, 10*time.Second)
	l.track(a, http.StateIdle)
	l.track(b, http.StateIdle) // a has been idle the longest

	// Accept waits in the kernel's accept queue: no newcomer, nothing closed.
	newcomer := make(chan net.Conn, 1)
	go func() {
		if c, err := l.Accept(); err == nil {
			newcomer <- c
		}
	}()
	if closedByServer(first, 200*time.Millisecond) {
		t.Fatal("an idle connection was closed at the cap with nobody waiting for its slot")
	}
	dialFrom(t, "127.0.0.2", addr)
	select {
	case c := <-newcomer:
		defer c.Close()
		l.track(c, http.StateActive)
	case <-time.After(10 * time.Second):
		t.Fatal("a newcomer at the cap was not accepted while a connection was idle")
	}
	if !closedByServer(first, 10*time.Second) {
		t.Error("the connection idle the longest is still open")
	}
	if closedByServer(second, 200*time.Millisecond) {
		t.Error("the connection idle for less time was closed too")
	}
	if n := testutil.ToFloat64(l.reclaimed.WithLabelValues("idle")); n != 1 {
		t.Errorf("kumiko_api_connections_reclaimed_total{state=idle} %v, want 1", n)
	}

	// Both slots in requests now: the next newcomer waits until one goes idle.
	l.track(b, http.StateActive)
	go func() {
		if c, err := l.Accept(); err == nil {
			newcomer <- c
		}
	}()
	dialFrom(t, "127.0.0.3", addr)
	select {
	case <-newcomer:
		t.Fatal("a newcomer was accepted while every connection was in a request")
	case <-time.After(200 * time.Millisecond):
	}
	l.track(b, http.StateIdle)
	select {
	case c := <-newcomer:
		c.Close()
	case <-time.After(10 * time.Second):
		t.Fatal("the newcomer was not accepted after a connection went idle")
	}
	if !closedByServer(second, 10*time.Second) {
		t.Error("the connection that went idle is still open")
	}
}

// At the cap, a connection that has sent no request header for silentGrace
// gives its slot to a newcomer, and the readiness check says so once, as
// degraded; one silent for less is left alone until then.
func TestCapListenerClosesSilentConnectionsPastTheirGrace(t *testing.T) {
	const grace = 300 * time.Millisecond
	l := testCapListener(t, connCap{max: 1, silentGrace: grace})
	addr := l.Addr().String()
	silent := dialFrom(t, "127.0.0.1", addr)
	acceptWithin(t, l, 10*time.Second) // silent from its accept on
	if res := l.connectionsCheck(context.Background()); !res.OK {
		t.Fatalf("check before anything was closed: %v", res.Detail)
	}

	start := time.Now()
	dialFrom(t, "127.0.0.2", addr)
	acceptWithin(t, l, 10*time.Second)
	if waited := time.Since(start); waited < grace {
		t.Errorf("the newcomer got a silent connection's slot after %s, before its grace of %s", waited, grace)
	}
	if !closedByServer(silent, 10*time.Second) {
		t.Error("the silent connection is still open")
	}
	res := l.connectionsCheck(context.Background())
	if res.OK || res.Detail["silentClosed"] != 1 {
		t.Errorf("check after a silent connection was closed to make room: ok=%v %v, want failed with silentClosed 1", res.OK, res.Detail)
	}
	if res := l.connectionsCheck(context.Background()); !res.OK {
		t.Errorf("the next check, with nothing closed since: %v", res.Detail)
	}
}

// A client address holds at most perClient connections; a further one is
// closed at once while other addresses get in, and its count drops as its
// connections close. A trusted proxy's address is not bounded.
func TestCapListenerBoundsEachClientAddress(t *testing.T) {
	l := testCapListener(t, connCap{max: 10, perClient: 2, trusted: []netip.Prefix{netip.MustParsePrefix("127.0.0.3/32")}})
	addr := l.Addr().String()
	dialFrom(t, "127.0.0.2", addr)
	first := acceptWithin(t, l, 10*time.Second)
	dialFrom(t, "127.0.0.2", addr)
	acceptWithin(t, l, 10*time.Second)

	over := dialFrom(t, "127.0.0.2", addr)
	dialFrom(t, "127.0.0.4", addr)
	other := acceptWithin(t, l, 10*time.Second) // past the one over its bound
	if got := other.RemoteAddr().(*net.TCPAddr).IP.String(); got != "127.0.0.4" {
		t.Fatalf("accepted a connection from %s, want 127.0.0.4's", got)
	}
	if !closedByServer(over, 10*time.Second) {
		t.Error("a third connection from an address bounded at 2 is still open")
	}
	if n := testutil.ToFloat64(l.refused); n != 1 {
		t.Errorf("kumiko_api_connections_refused_total %v, want 1", n)
	}

	first.Close()
	dialFrom(t, "127.0.0.2", addr)
	if c := acceptWithin(t, l, 10*time.Second); c.RemoteAddr().(*net.TCPAddr).IP.String() != "127.0.0.2" {
		t.Error("an address below its bound again was not accepted")
	}

	for range 4 {
		dialFrom(t, "127.0.0.3", addr)
		acceptWithin(t, l, 10*time.Second)
	}
	if n := testutil.ToFloat64(l.refused); n != 1 {
		t.Errorf("a trusted proxy's connections were refused: kumiko_api_connections_refused_total %v, want 1", n)
	}
}
