package main

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

// pprof on the ops port answers only with the admin token, and not at all
// without one configured.
func TestPprofNeedsTheAdminToken(t *testing.T) {
	serve := func(token string) *httptest.Server {
		lc := readyLifecycle(t)
		m := newMetrics()
		e := newEcho(newLogger(io.Discard, "json"), m, componentOps)
		addOpsRoutes(e, testReadiness(t, lc, m, time.Second, time.Second), m, defaultConfig().HTTP, token)
		srv := httptest.NewServer(e)
		t.Cleanup(srv.Close)
		return srv
	}
	get := func(url, auth string) (int, string) {
		resp, body := getBody(t, url, auth)
		return resp.StatusCode, string(body)
	}

	on := serve(testAdminToken)
	for _, path := range []string{"/debug/pprof/", "/debug/pprof/heap", "/debug/pprof/goroutine?debug=1", "/debug/pprof/cmdline"} {
		if code, body := get(on.URL+path, ""); code != http.StatusUnauthorized {
			t.Errorf("%s without a token: %d %s, want 401", path, code, body)
		}
		if code, body := get(on.URL+path, "Bearer wrong"); code != http.StatusUnauthorized {
			t.Errorf("%s with a wrong token: %d %s, want 401", path, code, body)
		}
		// The scheme is case-insensitive (RFC 9110 §11.1) and may be followed by more than one space.
		for _, auth := range []string{"Bearer " + testAdminToken, "bearer " + testAdminToken, "BEARER  " + testAdminToken} {
			if code, body := get(on.URL+path, auth); code != http.StatusOK || body == "" {
				t.Errorf("%s with %q: %d %.200s, want 200 and a body", path, auth, code, body)
			}
		}
		for _, auth := range []string{testAdminToken, "Bearer", "Bearer ", "Basic " + testAdminToken, "Bearer " + testAdminToken + "x", "Bearertoken " + testAdminToken} {
			if code, body := get(on.URL+path, auth); code != http.StatusUnauthorized {
				t.Errorf("%s with %q: %d %.200s, want 401", path, auth, code, body)
			}
		}
	}
	if code, body := get(on.URL+"/debug/pprof/goroutine?debug=1", "Bearer "+testAdminToken); !strings.Contains(body, "goroutine profile") {
		t.Errorf("goroutine profile: %d %.200s", code, body)
	}

	off := serve("")
	if code, _ := get(off.URL+"/debug/pprof/", "Bearer "+testAdminToken); code != http.StatusNotFound {
		t.Errorf("without a configured token /debug/pprof/ answered %d, want 404", code)
	}
}
