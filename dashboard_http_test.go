package main

import (
	"io"
	"net/http"
	"strings"
	"testing"
)

// The dashboard page is served at / on the API port, and /api/instance gives
// it this instance's state, boot timeline, the leader and the live workers.
func TestDashboardAndInstanceEndpoint(t *testing.T) {
	s := startInProcess(t, fastEnv(t))
	resp, err := http.Get(apiURL(s) + "/")
	if err != nil {
		t.Fatal(err)
	}
	page, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || !strings.Contains(resp.Header.Get("Content-Type"), "text/html") ||
		!strings.Contains(string(page), `new EventSource("/api/events")`) {
		t.Fatalf("GET / = %d %s", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	code, _, body, _ := get(t, http.DefaultClient, apiURL(s)+"/api/instance")
	phases, _ := body["phases"].([]any)
	workers, _ := body["workers"].([]any)
	if code != 200 || body["state"] != "ready" || len(phases) != len(phaseOrder) || len(workers) < 2 || body["leader"] == "" {
		t.Fatalf("/api/instance = %d %v", code, body)
	}
}
