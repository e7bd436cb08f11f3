package main

import (
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/riverqueue/river"
)

// The dashboard page is served at / on the API port, and /api/instance gives
// it this instance's state, boot timeline, the leader and the live workers.
func TestDashboardAndInstanceEndpoint(t *testing.T) {
	s := startInProcess(t, fastEnv(t))
	resp, page := getBody(t, apiURL(s)+"/", "")
	if resp.StatusCode != 200 || !strings.Contains(resp.Header.Get("Content-Type"), "text/html") ||
		!strings.Contains(string(page), `new EventSource("/api/events")`) {
		t.Fatalf("GET / = %d %s", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	// The election runs after ready and the endpoint caches for a second:
	// wait for the leader to show rather than expect it at once.
	var code int
	var body map[string]any
	waitFor(t, 10*time.Second, "/api/instance with the leader", func() bool {
		code, _, body, _ = get(t, http.DefaultClient, apiURL(s)+"/api/instance")
		return code == 200 && body["leader"] != nil && body["leader"] != ""
	})
	phases, _ := body["phases"].([]any)
	workers, _ := body["workers"].([]any)
	if code != 200 || body["state"] != "ready" || len(phases) != len(phaseOrder) || len(workers) < 2 {
		t.Fatalf("/api/instance = %d %v", code, body)
	}
}

// Every instance publishes its status record to Redis, and /api/instance
// lists them: state, the boot phases placed in time, no drain yet. A clean
// stop leaves a "stopped" record with the drain steps, kept for stoppedTTL.
func TestDashboardInstanceStatusRecords(t *testing.T) {
	env := fastEnv(t)
	s := startInProcess(t, env)
	id := env["KUMIKO_INSTANCE_ID"]
	var mine map[string]any
	waitFor(t, 10*time.Second, "this instance's ready record in /api/instance", func() bool {
		_, _, body, _ := get(t, http.DefaultClient, apiURL(s)+"/api/instance")
		instances, _ := body["instances"].([]any)
		for _, v := range instances {
			if m, _ := v.(map[string]any); m["instanceId"] == id && m["state"] == "ready" {
				mine = m
				return true
			}
		}
		return false
	})
	phases, _ := mine["phases"].([]any)
	if len(phases) != len(phaseOrder) || len(mine["drain"].([]any)) != 0 {
		t.Fatalf("record = %v", mine)
	}
	last := -1.0
	for _, p := range phases {
		start := p.(map[string]any)["startMs"].(float64)
		if start < last {
			t.Fatalf("phases not placed in time order: %v", phases)
		}
		last = start
	}

	if err := s.stop(t); err != nil {
		t.Fatal(err)
	}
	rdb := redisClient(t, env["REDIS_URL"])
	raw, err := rdb.Get(context.Background(), statusKeyPrefix+id).Result()
	if err != nil {
		t.Fatalf("the stopped record: %v", err)
	}
	t.Logf("the stopped record: %d bytes", len(raw))
	var st instanceStatus
	if err := json.Unmarshal([]byte(raw), &st); err != nil {
		t.Fatal(err)
	}
	var steps []string
	for _, d := range st.Drain {
		steps = append(steps, d.Step)
	}
	if st.State != "stopped" || len(steps) == 0 || steps[0] != "readiness" || steps[len(steps)-1] != "heartbeats" {
		t.Fatalf("stopped record = %s", raw)
	}
	if ttl := rdb.PTTL(context.Background(), statusKeyPrefix+id).Val(); ttl <= statusTTL || ttl > stoppedTTL {
		t.Fatalf("stopped record TTL %s, want above %s and at most %s", ttl, statusTTL, stoppedTTL)
	}
	linger := s.logs.find(map[string]any{"event": "linger_ended"})
	if linger == nil || st.LingerEnded != linger["ended"] || st.JobsInterrupted != 0 {
		t.Fatalf("stopped record: lingerEnded %q, jobsInterrupted %d; want the log's %v and 0: %s", st.LingerEnded, st.JobsInterrupted, linger, raw)
	}
}

// A job the drain cuts off is counted on the dashboard: the stopped record
// says how many jobs went back to the queue, and what ended the linger.
func TestDashboardRecordCountsInterruptedJobs(t *testing.T) {
	env := fastEnv(t)
	// The 5 s job outlasts the soft stop (under a second of this budget),
	// and its hard stop has room on a busy machine.
	env["KUMIKO_LINGER"], env["KUMIKO_DRAIN_TIMEOUT"], env["KUMIKO_SHUTDOWN_TIMEOUT"] = "0", "200ms", "3s"
	s := startInProcess(t, env)
	res, err := s.app.jobs.client.Insert(context.Background(), sleepArgs{Ms: 5000}, &river.InsertOpts{MaxAttempts: 1})
	if err != nil {
		t.Fatal(err)
	}
	pool := sharedPool(t, env)
	waitFor(t, 10*time.Second, "the job running", func() bool { return jobState(t, pool, res.Job.ID) == "running" })
	if err := s.stop(t); err != nil {
		t.Fatal(err)
	}
	raw, err := redisClient(t, env["REDIS_URL"]).Get(context.Background(), statusKeyPrefix+env["KUMIKO_INSTANCE_ID"]).Result()
	if err != nil {
		t.Fatalf("the stopped record: %v", err)
	}
	var st instanceStatus
	if err := json.Unmarshal([]byte(raw), &st); err != nil {
		t.Fatal(err)
	}
	if st.JobsInterrupted != 1 || st.LingerEnded != "max" { // a linger of 0 ends by its bound at once
		t.Fatalf("stopped record: jobsInterrupted %d, lingerEnded %q; want 1 and max: %s", st.JobsInterrupted, st.LingerEnded, raw)
	}
}
