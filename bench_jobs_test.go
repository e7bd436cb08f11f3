package main

// Leader and jobs figures, measured, not asserted:
//
//	go test -run '^$' -bench 'LeaderFailover' -benchtime 5x .
//	go test -run '^$' -bench 'JobsThroughput' -benchtime 10000x .
//
// BenchmarkLeaderFailover/<ttl>/<kill|term>   leader gone → follower leads (median of b.N)
// BenchmarkJobsThroughput                      River jobs/s, two instances working a backlog

import (
	"context"
	"maps"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
)

func BenchmarkLeaderFailover(b *testing.B) {
	for _, ttl := range []struct{ name, ttl, renew string }{{"ttl=1s", "1s", "250ms"}, {"ttl=15s", "15s", "5s"}} {
		for _, how := range []string{"kill", "term"} {
			b.Run(ttl.name+"/"+how, func(b *testing.B) {
				env := fastEnv(b)
				env["KUMIKO_LEADER_LOCK_TTL"], env["KUMIKO_LEADER_RENEW_INTERVAL"] = ttl.ttl, ttl.renew
				env["KUMIKO_LINGER"] = "0"
				var samples []time.Duration
				for i := 0; b.Loop(); i++ {
					leader := benchProc(b, env, "leader")
					becameLeader(leader, 20*time.Second)
					follower := benchProc(b, env, "follower")
					follower.waitReady()
					start := time.Now()
					if how == "kill" {
						leader.cmd.Process.Kill()
					} else {
						leader.signal(syscall.SIGTERM)
					}
					follower.waitLog(40*time.Second, map[string]any{"component": "leaderElection", "msg": "became leader"})
					samples = append(samples, time.Since(start))
					leader.wait(10 * time.Second)
					follower.signal(syscall.SIGTERM)
					follower.wait(10 * time.Second)
				}
				reportMedian(b, "failover", samples)
			})
		}
	}
}

// benchProc starts the service as instance id.
func benchProc(b *testing.B, env map[string]string, id string) *proc {
	e := maps.Clone(env)
	e["KUMIKO_INSTANCE_ID"] = id
	return startProc(b, e)
}

func BenchmarkJobsThroughput(b *testing.B) {
	for _, workers := range []string{"10", "100"} {
		b.Run("workers="+workers, func(b *testing.B) { benchmarkJobs(b, workers) })
	}
}

// benchmarkJobs: River fetches at most `workers` jobs per fetch, at most
// every FetchCooldown (100ms), so workers per instance bound the rate.
func benchmarkJobs(b *testing.B, workers string) {
	env := fastEnv(b)
	env["KUMIKO_JOBS_POLL_INTERVAL"] = "100ms"
	env["KUMIKO_JOBS_WORKERS"] = workers
	pool := sharedPool(b, env)
	mg, err := newMigrator(pool, time.Minute)
	if err != nil {
		b.Fatal(err)
	}
	mg.up(context.Background())
	mg.Close()

	inserter, err := river.NewClient(riverpgxv5.New(pool), &river.Config{})
	if err != nil {
		b.Fatal(err)
	}
	params := make([]river.InsertManyParams, b.N)
	for i := range params {
		params[i] = river.InsertManyParams{Args: sleepArgs{Ms: 0}}
	}
	err = pgx.BeginFunc(context.Background(), pool, func(tx pgx.Tx) error {
		_, err := inserter.InsertManyFastTx(context.Background(), tx, params)
		return err
	})
	if err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	start := time.Now()
	a, c := benchProc(b, env, "a"), benchProc(b, env, "b")
	waitFor(b, 5*time.Minute, "the backlog worked off", func() bool {
		var open int
		pool.QueryRow(context.Background(), `SELECT count(*) FROM river_job WHERE kind = 'sleep' AND state <> 'completed'`).Scan(&open)
		return open == 0
	})
	elapsed := time.Since(start)
	b.StopTimer()
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "jobs/s")
	a.signal(syscall.SIGTERM)
	c.signal(syscall.SIGTERM)
	a.wait(10 * time.Second)
	c.wait(10 * time.Second)
}
