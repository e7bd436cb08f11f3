package main

// Figures for the lifecycle, measured, not asserted:
//
//	go test -run '^$' -bench 'Lifecycle' -benchtime 10x .
//
// BenchmarkLifecycleBootToReady      median boot: process start → /health/ready 200
// BenchmarkLifecycleSIGTERMToExit    SIGTERM → exit with linger 0 and nothing in flight
// BenchmarkLifecycleReadinessStorm   /health/ready requests/s and the DB pings they cost

import (
	"context"
	"net/http"
	"os/exec"
	"slices"
	"syscall"
	"testing"
	"time"
)

// benchEnv is fastEnv for a benchmark: fixed ops port so readiness can be
// polled from the first millisecond, migrations already applied.
func benchEnv(b *testing.B) (map[string]string, string) {
	b.Helper()
	env := map[string]string{
		"DATABASE_URL":      testPostgres(b),
		"REDIS_URL":         testRedis(b).URL,
		"KUMIKO_MASTER_KEY": testMasterKey,
		"KUMIKO_HTTP_ADDR":  freeTCPAddr(b),
		"KUMIKO_OPS_ADDR":   freeTCPAddr(b),
		"KUMIKO_LOG_FORMAT": "json",
		"KUMIKO_LINGER":     "0",
	}
	getenv := func(k string) string { return env[k] }
	if err := run(context.Background(), []string{serviceName, "migrate", "up"}, getenv, nil, discard{}, discard{}); err != nil {
		b.Fatal(err)
	}
	return env, "http://" + env["KUMIKO_OPS_ADDR"]
}

type discard struct{}

func (discard) Write(p []byte) (int, error) { return len(p), nil }

func benchCmd(env map[string]string) *exec.Cmd {
	cmd := exec.Command(testBinary)
	cmd.Dir = "/"
	for k, v := range env {
		cmd.Env = append(cmd.Env, k+"="+v)
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	return cmd
}

// waitReady200 polls readiness every millisecond until it answers 200.
func waitReady200(b *testing.B, ops string) {
	client := &http.Client{Timeout: time.Second}
	var last string
	if !poll(20*time.Second, time.Millisecond, func() bool {
		resp, err := client.Get(ops + "/health/ready")
		if err != nil {
			last = err.Error()
			return false
		}
		resp.Body.Close()
		last = resp.Status
		return resp.StatusCode == 200
	}) {
		b.Fatalf("not ready within 20s; last answer: %s", last)
	}
}

func reportMedian(b *testing.B, name string, samples []time.Duration) {
	slices.Sort(samples)
	b.ReportMetric(float64(samples[len(samples)/2].Microseconds())/1000, name+"-p50-ms")
	b.ReportMetric(float64(samples[len(samples)-1].Microseconds())/1000, name+"-max-ms")
}

// timeBoot starts the service, times process start → readiness 200, and stops it.
func timeBoot(b *testing.B, env map[string]string, ops string) time.Duration {
	cmd := benchCmd(env)
	start := time.Now()
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	waitReady200(b, ops)
	took := time.Since(start)
	cmd.Process.Signal(syscall.SIGTERM)
	cmd.Wait()
	return took
}

func BenchmarkLifecycleBootToReady(b *testing.B) {
	env, ops := benchEnv(b)
	var boots []time.Duration
	for b.Loop() {
		boots = append(boots, timeBoot(b, env, ops))
	}
	reportMedian(b, "boot", boots)
}

func BenchmarkLifecycleSIGTERMToExit(b *testing.B) {
	env, ops := benchEnv(b)
	var stops []time.Duration
	for b.Loop() {
		cmd := benchCmd(env)
		if err := cmd.Start(); err != nil {
			b.Fatal(err)
		}
		waitReady200(b, ops)
		start := time.Now()
		cmd.Process.Signal(syscall.SIGTERM)
		if err := cmd.Wait(); err != nil {
			b.Fatalf("exit: %v", err)
		}
		stops = append(stops, time.Since(start))
	}
	reportMedian(b, "sigterm-to-exit", stops)
}

// dbProbes reads kumiko_readiness_probes_total{check="db"} from /metrics.
func dbProbes(b *testing.B, ops string) float64 {
	b.Helper()
	v, err := scrapeMetric(ops, `kumiko_readiness_probes_total{check="db"}`)
	if err != nil {
		b.Fatal(err)
	}
	return v
}

// BenchmarkLifecycleReadinessStorm: many clients hammer /health/ready; the
// DB is pinged once per cache TTL (1s by default) however hard they push.
func BenchmarkLifecycleReadinessStorm(b *testing.B) {
	env, ops := benchEnv(b)
	env["KUMIKO_READINESS_CHECK_INTERVAL"] = "1s"
	cmd := benchCmd(env)
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	defer func() { cmd.Process.Signal(syscall.SIGTERM); cmd.Wait() }()
	waitReady200(b, ops)
	pingsBefore := dbProbes(b, ops)

	transport := &http.Transport{MaxIdleConnsPerHost: 256}
	client := &http.Client{Transport: transport}
	b.SetParallelism(32)
	start := time.Now()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			resp, err := client.Get(ops + "/health/ready")
			if err != nil {
				b.Error(err)
				return
			}
			resp.Body.Close()
		}
	})
	elapsed := time.Since(start)
	pings := dbProbes(b, ops) - pingsBefore
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "probes/s")
	b.ReportMetric(pings/elapsed.Seconds(), "db-pings/s")
}
