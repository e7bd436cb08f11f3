package main

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"io"
	"net"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
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

// The connection cap's listener: an Accept waiting for a free slot returns
// as soon as the listener is closed (the drain closes it, possibly at the
// cap), and a connection closed twice gives its slot back once.
func TestCapListenerStopsWaitingWhenClosed(t *testing.T) {
	base, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	l := newCapListener(base.(*net.TCPListener), 1)
	client, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	held, err := l.Accept() // takes the only slot
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := held.(interface{ SetWriteBuffer(int) error }); !ok {
		t.Errorf("an accepted %T cannot size its send buffer (limitSendBuffer)", held)
	}

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
	if n := len(l.slots); n != 0 {
		t.Errorf("%d slots taken after the only connection was closed twice, want 0", n)
	}
}
