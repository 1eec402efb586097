// Prompt lookup: the drafts are what followed the longest n-gram (min..max)
// that ends the sequence and occurred before, from its earliest occurrence;
// nothing when nothing repeats; never more than asked or than the sequence
// holds after the match.
#include "engine/ngram_proposer.h"

#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace accel::engine {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

TEST(NgramProposerTest, TheLongestMatchFromItsEarliestOccurrence) {
  NgramProposer p(/*min_n=*/1, /*max_n=*/3, /*k=*/4);
  // "... 7 8 9" occurs at the start, followed by 1 2 3 4; "8 9" alone also
  // occurs later (followed by 5): the 3-gram wins.
  const std::vector<int64_t> ids = {7, 8, 9, 1, 2, 3, 4, 6, 8, 9, 5, 0, 7, 8, 9};
  EXPECT_THAT(p.Propose(ids, 4), ElementsAre(1, 2, 3, 4));
  EXPECT_THAT(p.Propose(ids, 2), ElementsAre(1, 2));  // the caller's limit
  NgramProposer two(1, 3, 2);
  EXPECT_THAT(two.Propose(ids, 10), ElementsAre(1, 2));  // num_speculative_tokens
}

TEST(NgramProposerTest, AShorterNgramWhenTheLongerOnesDoNotRepeat) {
  NgramProposer p(2, 4, 3);
  // The last 4, 3 tokens never occurred before; the last 2 ("5 6") did.
  const std::vector<int64_t> ids = {5, 6, 1, 2, 9, 9, 9, 5, 6};
  EXPECT_THAT(p.Propose(ids, 3), ElementsAre(1, 2, 9));
  // min_n 3: no match at all.
  NgramProposer strict(3, 4, 3);
  EXPECT_THAT(strict.Propose(ids, 3), IsEmpty());
}

TEST(NgramProposerTest, NothingWhenNothingRepeatsAndTheContinuationEndsAtTheSequence) {
  NgramProposer p(1, 2, 5);
  EXPECT_THAT(p.Propose({1, 2, 3, 4}, 5), IsEmpty());
  EXPECT_THAT(p.Propose({}, 5), IsEmpty());
  EXPECT_THAT(p.Propose({3}, 5), IsEmpty());
  // A loop: "1 2" then its continuation runs into the sequence's end.
  EXPECT_THAT(p.Propose({1, 2, 1, 2}, 5), ElementsAre(1, 2));
  EXPECT_THAT(p.Propose({1, 2, 3, 1, 2}, 0), IsEmpty());
}

}  // namespace
}  // namespace accel::engine
