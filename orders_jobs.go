package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/meilisearch/meilisearch-go"
	"github.com/minio/minio-go/v7"
	"github.com/riverqueue/river"
	"golang.org/x/sync/errgroup"
)

// The orders demo's jobs. Each worker must be idempotent: River runs a job
// again after a crash.

// indexOrderArgs: order.created → the orders in Meilisearch. One job carries
// the orders of one delivery batch: a search index takes many documents in
// one call as cheaply as one, and River's cost is per job, not per order.
type indexOrderArgs struct {
	OrderIDs []int64 `json:"orderIds"`
}

func (indexOrderArgs) Kind() string { return "indexOrder" }

// writeReceiptArgs: order.created → a sealed receipt object in S3 per order,
// the orders of one delivery batch in one job.
type writeReceiptArgs struct {
	OrderIDs []int64 `json:"orderIds"`
}

func (writeReceiptArgs) Kind() string { return "writeReceipt" }

// reportArgs is one report, on a cron tick or by hand.
type reportArgs struct{ CronRun }

func (reportArgs) Kind() string { return "report" }

// receiptWrites bounds the receipts one job writes to S3 at once: the
// object store's round trips overlap, and one job does not open a connection
// per order.
const receiptWrites = 8

// indexOrder puts the orders into the Meilisearch index in one call
// (replacing any earlier copy).
func indexOrder(d workDeps, ctx context.Context, job *river.Job[indexOrderArgs]) error {
	if d.search == nil {
		return nil // search not configured: nothing to index into
	}
	orders, err := loadOrders(ctx, d.db, job.Args.OrderIDs)
	if err != nil {
		return err
	}
	pk := "id"
	ctx, cancel := d.external(ctx)
	defer cancel()
	if _, err := d.search.Index(ordersIndex).AddDocuments(ctx, orders, &meilisearch.DocumentOptions{PrimaryKey: &pk}); err != nil {
		return fmt.Errorf("indexing %d orders: %w", len(orders), err)
	}
	return nil
}

// writeReceipt stores each order's receipt in S3, sealed with the master key:
// the object store never sees a customer's order in the clear. A retry
// writes every receipt of the job again; the same order always makes the
// same object name, so a receipt is replaced, never doubled.
func writeReceipt(d workDeps, ctx context.Context, job *river.Job[writeReceiptArgs]) error {
	if d.storage == nil {
		return nil
	}
	orders, err := loadOrders(ctx, d.db, job.Args.OrderIDs)
	if err != nil {
		return err
	}
	g, ctx := errgroup.WithContext(ctx)
	g.SetLimit(receiptWrites)
	for _, o := range orders {
		g.Go(func() error { return putReceipt(d, ctx, o) })
	}
	return g.Wait()
}

func putReceipt(d workDeps, ctx context.Context, o order) error {
	plain, _ := json.Marshal(o)
	name := fmt.Sprintf("receipts/%d.sealed", o.ID)
	sealed := d.masterKey.seal(plain, []byte(name))
	ctx, cancel := d.external(ctx)
	defer cancel()
	_, err := d.storage.PutObject(ctx, d.bucket, name, bytes.NewReader(sealed), int64(len(sealed)),
		minio.PutObjectOptions{ContentType: "application/octet-stream", UserMetadata: map[string]string{"Key-Id": d.masterKey.id}})
	if err != nil {
		return fmt.Errorf("writing %s: %w", name, err)
	}
	return nil
}

// writeReport counts the orders so far and stores the count as
// reports/<scheduled time>.json (the same tick always writes the same object).
func writeReport(d workDeps, ctx context.Context, job *river.Job[reportArgs]) error {
	var orders, pending int64
	err := d.db.QueryRow(ctx, `SELECT (SELECT count(*) FROM orders),
		(SELECT count(*) FROM outbox_events WHERE delivered_at IS NULL AND dead_at IS NULL)`).Scan(&orders, &pending)
	if err != nil {
		return fmt.Errorf("counting for the report: %w", err)
	}
	report, _ := json.Marshal(map[string]any{"scheduledAt": job.Args.ScheduledAt, "manual": job.Args.Manual,
		"orders": orders, "pendingEvents": pending, "fencingToken": job.Args.FencingToken})
	if d.storage == nil {
		d.log.WithField("report", string(report)).Info("report (no S3 configured)")
		return nil
	}
	name := "reports/" + job.Args.ScheduledAt.UTC().Format(time.RFC3339Nano) + ".json"
	ctx, cancel := d.external(ctx)
	defer cancel()
	_, err = d.storage.PutObject(ctx, d.bucket, name, bytes.NewReader(report), int64(len(report)),
		minio.PutObjectOptions{ContentType: "application/json"})
	if err != nil {
		return fmt.Errorf("writing %s: %w", name, err)
	}
	return nil
}

// loadOrders loads the orders with these ids, every one of them: an id
// without its order fails the job (River retries it, then discards it).
func loadOrders(ctx context.Context, db *pgxpool.Pool, ids []int64) ([]order, error) {
	orders, err := collectOrders(db.Query(ctx, `SELECT `+orderColumns+` FROM orders WHERE id = ANY ($1::bigint[]) ORDER BY id`, ids))
	if err != nil {
		return nil, fmt.Errorf("loading %d orders: %w", len(ids), err)
	}
	found := make(map[int64]bool, len(orders))
	for _, o := range orders {
		found[o.ID] = true
	}
	var missing []int64
	for _, id := range ids {
		if !found[id] {
			missing = append(missing, id)
		}
	}
	if len(missing) > 0 {
		return nil, fmt.Errorf("loading orders: %v not found", missing)
	}
	return orders, nil
}
