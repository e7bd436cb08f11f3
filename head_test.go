package main

import (
	"net/http"
	"testing"
	"time"
)

// HEAD answers like GET wherever GET answers, on both ports: the same status
// and headers, no body (issue 20: the health routes and the page were 405;
// issue 33: the features' routes, /metrics and /admin were too). The event
// stream answers HEAD with its headers at once instead of streaming.
func TestHeadAnswersLikeGet(t *testing.T) {
	env := fastEnv(t, "KUMIKO_ADMIN_TOKEN="+testAdminToken)
	s := startInProcess(t, env)
	api, ops := apiURL(s), opsURL(s)
	client := &http.Client{Timeout: 5 * time.Second} // a HEAD that streams would hang here
	for _, url := range []string{api + "/", api + "/health", api + "/health/ready", api + "/api/instance", api + "/api/slow?ms=1",
		ops + "/health", ops + "/health/ready", ops + "/metrics", ops + "/admin/lifecycle", ops + "/admin/workers"} {
		do := func(method string) (*http.Response, []byte) {
			req, _ := http.NewRequest(method, url, nil)
			req.Header.Set("Authorization", "Bearer "+testAdminToken)
			return roundTrip(t, client, req)
		}
		get, _ := do(http.MethodGet)
		head, body := do(http.MethodHead)
		if head.StatusCode != get.StatusCode || head.Header.Get("Content-Type") != get.Header.Get("Content-Type") || len(body) != 0 {
			t.Errorf("HEAD %s = %d %q with %d body bytes; GET = %d %q", url, head.StatusCode, head.Header.Get("Content-Type"), len(body), get.StatusCode, get.Header.Get("Content-Type"))
		}
	}

	start := time.Now()
	resp, err := client.Head(api + "/api/events")
	if err != nil {
		t.Fatalf("HEAD /api/events: %v", err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || resp.Header.Get("Content-Type") != "text/event-stream" {
		t.Errorf("HEAD /api/events = %d %q after %s, want 200 text/event-stream at once", resp.StatusCode, resp.Header.Get("Content-Type"), time.Since(start))
	}
}
