// Command riverbench measures River on its own, as `river bench` (River's
// CLI, not served by the module proxy here) does, with its settings (2,000
// workers, a fetch every 2 ms, a poll every 20 ms: cmd/river/riverbench): it
// inserts -jobs jobs that do nothing into a queue of their own, works them
// with one client, and prints how many it completed per second. It is the
// yardstick for the service's jobs (scripts/bench-followup.sh): what River
// itself does on this database and this machine when a job costs nothing.
//
//	DATABASE_URL=postgres://… go run ./scripts/riverbench -jobs 50000
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"os"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
)

type noopArgs struct{}

func (noopArgs) Kind() string { return "riverbench_noop" }

type noopWorker struct{ river.WorkerDefaults[noopArgs] }

func (noopWorker) Work(context.Context, *river.Job[noopArgs]) error { return nil }

func main() {
	jobs := flag.Int("jobs", 50000, "jobs to insert, then work")
	workers := flag.Int("workers", 2000, "the client's workers (river bench: 2,000)")
	flag.Parse()
	if err := run(os.Getenv("DATABASE_URL"), *jobs, *workers); err != nil {
		log.Fatal(err)
	}
}

func run(dbURL string, n, workers int) error {
	ctx := context.Background()
	db, err := pgxpool.New(ctx, dbURL)
	if err != nil {
		return fmt.Errorf("connecting: %w", err)
	}
	defer db.Close()
	ws := river.NewWorkers()
	river.AddWorker(ws, noopWorker{})
	const queue = "riverbench"
	client, err := river.NewClient(riverpgxv5.New(db), &river.Config{
		FetchCooldown: 2 * time.Millisecond, FetchPollInterval: 20 * time.Millisecond, // as river bench
		Queues: map[string]river.QueueConfig{queue: {MaxWorkers: workers}}, Workers: ws})
	if err != nil {
		return fmt.Errorf("creating the client: %w", err)
	}
	params := make([]river.InsertManyParams, n)
	for i := range params {
		params[i] = river.InsertManyParams{Args: noopArgs{}, InsertOpts: &river.InsertOpts{Queue: queue}}
	}
	for i := 0; i < n; i += 10000 {
		if _, err := client.InsertManyFast(ctx, params[i:min(i+10000, n)]); err != nil {
			return fmt.Errorf("inserting: %w", err)
		}
	}
	// A buffer for every job: a subscriber that falls behind loses events.
	completed, cancel := client.SubscribeConfig(&river.SubscribeConfig{Kinds: []river.EventKind{river.EventKindJobCompleted}, ChanSize: n})
	defer cancel()
	start := time.Now()
	if err := client.Start(ctx); err != nil {
		return fmt.Errorf("starting: %w", err)
	}
	for done := 0; done < n; done++ {
		select {
		case <-completed:
		case <-time.After(time.Minute):
			return fmt.Errorf("%d of %d jobs completed, then none for a minute", done, n)
		}
	}
	elapsed := time.Since(start)
	stopCtx, stop := context.WithTimeout(ctx, 10*time.Second)
	defer stop()
	if err := client.Stop(stopCtx); err != nil {
		return fmt.Errorf("stopping: %w", err)
	}
	fmt.Printf("river_jobs=%d workers=%d seconds=%.2f jobs_per_s=%.0f\n", n, workers, elapsed.Seconds(), float64(n)/elapsed.Seconds())
	return nil
}
