// Checks every fused kernel's task list shares (tests/cpu/test_forward_tasks.cpp, test_backward_tasks.cpp):
// the sequential walk of a cursor, and a cursor fed the sparse increasing tickets one CTA sees, which must
// give the walk's tasks and then the end.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

namespace pounce::test {

// Every task of `shape`'s list, ticket by ticket.
template <typename Cursor, typename TaskT, typename Shape>
std::vector<TaskT> walk(const Shape& shape) {
  Cursor cursor(shape);
  std::vector<TaskT> tasks;
  TaskT task{};
  for (int32_t ticket = 0; cursor.at(ticket, task); ++ticket) tasks.push_back(task);
  return tasks;
}

// A fresh cursor asked random increasing tickets: `same(got, expected, ticket)` checks each against the
// walk; past the list the cursor must say so.
template <typename Cursor, typename TaskT, typename Shape, typename Same>
void expect_sparse_tickets_match(const Shape& shape, const std::vector<TaskT>& tasks, Same&& same) {
  std::mt19937 gen(static_cast<uint32_t>(tasks.size()));
  Cursor cursor(shape);
  int32_t ticket = 0;
  TaskT task{};
  while (true) {
    ticket += std::uniform_int_distribution<int32_t>(1, 40)(gen);
    const bool has = cursor.at(ticket, task);
    ASSERT_EQ(has, ticket < static_cast<int32_t>(tasks.size())) << "ticket " << ticket;
    if (!has) break;
    same(task, tasks[ticket], ticket);
  }
}

}  // namespace pounce::test
